"""Signals of a run's health: metric log lines, a loss-curve PNG, labelled validation grids, the failure reason.

Log lines are JSON on stdout from rank 0. A training line reads

    {"step": 200, "stage": 0, "loss": 0.123456, "lr": 0.0001, "grad_norm": 0.51234,
     "img_per_s": 812.3, "data_wait_share": 0.0012, "skipped_steps": 0, "corrupt_samples": 0,
     "steps": 1000, "progress": 0.2, "eta_s": 412.5}

with the figures over the steps since the previous line (loss averaged over ranks and steps;
img/s counting every rank's images). SageMaker parses them with contracts.metrics, the definitions
the training job's request carries (docs/trainer.md lists them).

Pictures are drawn with Pillow (already a dependency), so no plotting library is needed.
"""

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image, ImageDraw, ImageFont

from trainer.report.render import log_ticks, nice_ticks, tick_label  # the report's round axis ticks


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


INK, FAINT = (34, 34, 34), (225, 225, 225)
MIN_TILE = 128  # a validation sample is drawn at least this big (whole-number NEAREST zoom), labels legible beside it


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's own font at `size` px (no font file needed); its bitmap font where FreeType is missing."""
    try:
        return ImageFont.load_default(size=size)
    except (ImportError, OSError, TypeError):
        return ImageFont.load_default()


def _put(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, font, align: str = "lt", fill=INK) -> None:
    """Text placed by one of its points: `align` is l/m/r (left, middle, right) then t/m/b (top, middle, bottom)."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = xy[0] - {"l": 0, "m": (right - left) / 2, "r": right - left}[align[0]] - left
    y = xy[1] - {"t": 0, "m": (bottom - top) / 2, "b": bottom - top}[align[1]] - top
    draw.text((x, y), text, font=font, fill=fill)


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: float, cut: bool = False) -> str:
    """`text`, shortened with "..." until it is no wider than `width` (and marked cut when `cut`)."""
    if not cut and draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text.rstrip() + "..."


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: float, lines: int) -> list[str]:
    """`text` broken at spaces into at most `lines` lines no wider than `width`; what does not fit is cut."""
    wrapped: list[str] = []
    for word in text.split():
        joined = f"{wrapped[-1]} {word}" if wrapped else word
        if wrapped and draw.textlength(joined, font=font) <= width:
            wrapped[-1] = joined
        else:
            wrapped.append(word)
    wrapped = [_fit(draw, line, font, width) for line in wrapped] or [""]
    return wrapped if len(wrapped) <= lines else wrapped[:lines - 1] + [_fit(draw, wrapped[lines - 1], font, width, cut=True)]


def _vertical_text(image: Image.Image, centre: tuple[float, float], text: str, font) -> None:
    """`text` read bottom to top (an axis title), centred on `centre`."""
    probe = ImageDraw.Draw(image)
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    band = Image.new("RGB", (right - left + 4, bottom - top + 4), "white")
    ImageDraw.Draw(band).text((2 - left, 2 - top), text, font=font, fill=INK)
    band = band.rotate(90, expand=True)
    image.paste(band, (int(centre[0] - band.width / 2), int(centre[1] - band.height / 2)))


def draw_loss_curve(history: list[tuple[int, float]], path: Path, size: tuple[int, int] = (800, 400)) -> None:
    """Loss against step as a PNG: the logged points on a log-scale loss axis, round ticks on both axes."""
    width, height = size
    left, right, top, bottom = 84, 24, 36, 58
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    title, small = _font(16), _font(13)
    points = [(step, loss) for step, loss in history if loss is not None and math.isfinite(loss) and loss > 0]
    if points:
        steps, losses = [step for step, _ in points], [loss for _, loss in points]
        x_ticks, y_ticks = nice_ticks(min(steps), max(steps), 8, integer=True), log_ticks(min(losses), max(losses))
        x0, x1 = min(x_ticks[0], min(steps)), max(x_ticks[-1], max(steps))
        y0, y1 = math.log10(min(y_ticks[0], min(losses))), math.log10(max(y_ticks[-1], max(losses)))

        def place(step: float, loss: float) -> tuple[float, float]:
            x = left + (step - x0) / (x1 - x0) * (width - left - right)
            y = height - bottom - (math.log10(loss) - y0) / (y1 - y0) * (height - top - bottom)
            return x, y

        for tick in x_ticks:
            x, _ = place(tick, 10 ** y0)
            draw.line((x, height - bottom, x, height - bottom + 5), fill=INK)
            _put(draw, (x, height - bottom + 8), tick_label(tick), small, "mt")
        for tick in y_ticks:
            _, y = place(x0, tick)
            draw.line((left, y, width - right, y), fill=FAINT)
            draw.line((left - 5, y, left, y), fill=INK)
            _put(draw, (left - 8, y), tick_label(tick), small, "rm")
        xy = [place(step, loss) for step, loss in points]
        if len(xy) > 1:
            draw.line(xy, fill="navy", width=2)
        else:
            draw.ellipse((xy[0][0] - 3, xy[0][1] - 3, xy[0][0] + 3, xy[0][1] + 3), fill="navy")
    else:
        _put(draw, (width / 2, height / 2), "no finite loss logged yet", small, "mm", fill=(119, 119, 119))
    draw.rectangle((left, top, width - right, height - bottom), outline=INK)
    _put(draw, (left, 10), "training loss (log scale)", title)
    _put(draw, ((left + width - right) / 2, height - 6), "step", small, "mb")
    _vertical_text(image, (14, (top + height - bottom) / 2), "loss", small)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


class GridLayout(NamedTuple):
    """Where a validation grid's parts go, in pixels: the prompts' column, the seeds' row, the tiles."""

    resolution: int  # a sample's side as generated
    tile: int  # as drawn: zoomed by a whole number
    gap: int
    label_width: int
    header: int
    font_size: int
    rows: int
    columns: int

    @property
    def size(self) -> tuple[int, int]:
        return self.label_width + self.columns * (self.tile + self.gap), self.header + self.rows * (self.tile + self.gap)

    def corner(self, row: int, column: int) -> tuple[int, int]:
        """The top-left pixel of the tile of `row` (a prompt) and `column` (a seed)."""
        return self.label_width + column * (self.tile + self.gap), self.header + row * (self.tile + self.gap)


def grid_layout(resolution: int, rows: int, columns: int) -> GridLayout:
    """The layout of a grid of `rows` prompts by `columns` seeds of `resolution`-pixel samples."""
    tile = resolution * math.ceil(MIN_TILE / resolution)
    font_size = max(14, tile // 8)
    return GridLayout(resolution, tile, max(2, tile // 64), int(tile * 1.5), int(font_size * 2.3), font_size, rows, columns)


def label_grid(images: list[Image.Image], prompts: list[str], seeds: list[int]) -> Image.Image:
    """The samples as a grid, row by prompt and column by seed, each row labelled with its prompt and
    each column with its seed; small samples are zoomed (NEAREST) to at least MIN_TILE pixels."""
    layout = grid_layout(max(max(image.size) for image in images), len(prompts), len(seeds))
    tile, font, line = layout.tile, _font(layout.font_size), layout.font_size * 1.3
    grid = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(grid)
    zoom = tile // layout.resolution
    _put(draw, (8, layout.header / 2), f"{layout.resolution} px" + (f", shown x{zoom}" if zoom > 1 else ""),
         _font(int(layout.font_size * 0.8)), "lm", fill=(119, 119, 119))
    for column, seed in enumerate(seeds):
        _put(draw, (layout.corner(0, column)[0] + tile / 2, layout.header / 2), f"seed {seed}", font, "mm")
    draw.line((0, layout.header - layout.gap / 2, grid.width, layout.header - layout.gap / 2), fill=FAINT)
    for row, prompt in enumerate(prompts):
        lines = _wrap(draw, prompt, font, layout.label_width - 16, max(1, int(tile // line)))
        for number, text in enumerate(lines):
            _put(draw, (8, layout.corner(row, 0)[1] + tile / 2 + (number - (len(lines) - 1) / 2) * line), text, font, "lm")
    for number, image in enumerate(images):
        row, column = divmod(number, len(seeds))
        grid.paste(image.convert("RGB").resize((tile, tile), Image.Resampling.NEAREST), layout.corner(row, column))
    return grid


@torch.no_grad()
def validation_grid(pipeline, prompts: list[str], seeds: list[int], resolution: int, steps: int,
                    embeddings: dict[str, torch.Tensor] | None = None) -> Image.Image:
    """One row per prompt, one column per seed, labelled with them; the same prompts and seeds at every checkpoint.
    `embeddings`: the prompts' pipeline embeddings (a pipeline without text encoders samples from them)."""
    # imported here: the watchdog imports this module in every process, and families pulls in every pipeline
    from trainer.models.families import negative_prompt, sampling_options
    pipeline.set_progress_bar_config(disable=True)
    generators = [torch.Generator("cpu").manual_seed(seed) for _ in prompts for seed in seeds]
    if embeddings is not None:
        device = pipeline.transformer.device
        text = {name: tensor.repeat_interleave(len(seeds), dim=0).to(device) for name, tensor in embeddings.items()}
        text["negative_prompt"] = None  # the negative's embeddings are among them (PixArt would take "" too)
        words = []
    else:
        text = {"negative_prompt": negative_prompt(pipeline, None)}  # Flux guides only with one
        words = [[prompt for prompt in prompts for _ in seeds]]
    images = pipeline(*words, **text, num_inference_steps=steps, generator=generators,
                      height=resolution, width=resolution, **sampling_options(pipeline)).images
    return label_grid(images, prompts, seeds)
