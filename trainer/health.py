"""Signals of a run's health: metric log lines, a loss-curve PNG, validation grids, the failure reason.

Log lines are JSON on stdout from rank 0. A training line reads

    {"step": 200, "stage": 0, "loss": 0.123456, "lr": 0.0001, "grad_norm": 0.51234,
     "img_per_s": 812.3, "data_wait_share": 0.0012, "skipped_steps": 0, "corrupt_samples": 0,
     "steps": 1000, "progress": 0.2, "eta_s": 412.5}

with the figures over the steps since the previous line (loss averaged over ranks and steps;
img/s counting every rank's images). docs/trainer.md lists the SageMaker metric regexes.

Pictures are drawn with Pillow (already a dependency), so no plotting library is needed.
"""

import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw


# SageMaker MetricDefinitions for these lines (docs/trainer.md lists them for the training-job request).
METRIC_DEFINITIONS = [
    {"Name": f"train:{field}", "Regex": f'"{field}": ([-+0-9.eE]+)'}
    for field in ("loss", "lr", "grad_norm", "img_per_s", "data_wait_share", "skipped_steps", "corrupt_samples")
]


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient."""


def log(rank: int, **fields) -> None:
    """One JSON line on stdout, from rank 0 only."""
    if rank == 0:
        print(json.dumps(fields), flush=True)


class Window:
    """Figures over the steps since the last log line."""

    def __init__(self):
        self.start = time.perf_counter()
        self.data_wait = 0.0
        self.images = 0
        self.loss_sum = torch.zeros(())
        self.good_steps = 0
        self.grad_norm = 0.0

    def wait_for(self, batches):
        """The next batch, its waiting time counted."""
        started = time.perf_counter()
        batch = next(batches)
        self.data_wait += time.perf_counter() - started
        return batch

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (checkpoints, validation) is left out of img/s and the data-wait share."""
        started = time.perf_counter()
        yield
        self.start += time.perf_counter() - started

    def figures(self, loss_mean: float) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "loss": round(loss_mean, 6) if math.isfinite(loss_mean) else None,  # None: every step was skipped
            "grad_norm": round(self.grad_norm, 6),
            "img_per_s": round(self.images / elapsed, 2),
            "data_wait_share": round(self.data_wait / elapsed, 4),
        }


def write_failure(reason: str) -> None:
    """SageMaker's failure file (<SM_OUTPUT_DIR>/failure; its first 1,024 characters become FailureReason)."""
    output_dir = os.environ.get("SM_OUTPUT_DIR")
    if output_dir:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "failure").write_text(reason + "\n")


def draw_loss_curve(history: list[tuple[int, float]], path: Path, size: tuple[int, int] = (800, 400)) -> None:
    """Loss against step as a PNG: the logged points, a log-scale loss axis, the range written on it."""
    width, height, margin = *size, 50
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((margin, margin // 2, width - margin // 2, height - margin), outline="black")
    points = [(step, loss) for step, loss in history if loss is not None and math.isfinite(loss) and loss > 0]
    if points:
        steps, logs = [step for step, _ in points], [math.log10(loss) for _, loss in points]
        low_step, high_step = min(steps), max(max(steps), min(steps) + 1)
        low_log, high_log = min(logs), max(max(logs), min(logs) + 1e-6)

        def place(step, value):
            x = margin + (step - low_step) / (high_step - low_step) * (width - 1.5 * margin)
            y = height - margin - (value - low_log) / (high_log - low_log) * (height - 1.5 * margin)
            return x, y

        xy = [place(step, value) for step, value in zip(steps, logs)]
        if len(xy) > 1:
            draw.line(xy, fill="navy", width=2)
        else:
            draw.ellipse((xy[0][0] - 2, xy[0][1] - 2, xy[0][0] + 2, xy[0][1] + 2), fill="navy")
        draw.text((margin, height - margin + 8), f"step {low_step}", fill="black")
        draw.text((width - 2 * margin - 20, height - margin + 8), f"step {max(steps)}", fill="black")
        draw.text((4, margin // 2), f"{10 ** high_log:.4g}", fill="black")
        draw.text((4, height - margin - 12), f"{10 ** low_log:.4g}", fill="black")
    draw.text((margin, 4), "training loss (log scale)", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


@torch.no_grad()
def validation_grid(pipeline, prompts: list[str], seeds: list[int], resolution: int, steps: int) -> Image.Image:
    """One row per prompt, one column per seed; the same prompts and seeds at every checkpoint."""
    pipeline.set_progress_bar_config(disable=True)
    generators = [torch.Generator("cpu").manual_seed(seed) for _ in prompts for seed in seeds]
    images = pipeline([prompt for prompt in prompts for _ in seeds], num_inference_steps=steps, generator=generators,
                      height=resolution, width=resolution).images
    grid = Image.new("RGB", (resolution * len(seeds), resolution * len(prompts)), "white")
    for number, image in enumerate(images):
        row, column = divmod(number, len(seeds))
        grid.paste(image, (column * resolution, row * resolution))
    return grid
