"""TensorBoard event files of a training run, where ML engineers look for them.

SageMaker uploads what the job writes under TensorBoardOutputConfig.LocalPath (/opt/ml/output/tensorboard,
the request sets it) to the job's S3OutputPath while it runs, and its TensorBoard app reads them;
locally `atelier tensorboard JOB` fetches them and prints the directory to open with `tensorboard
--logdir`. Written by tensorboardX's SummaryWriter (the event-file format without TensorFlow or the
tensorboard server in the image), by rank 0 only: the figures it logs are already all-rank means.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

SCALARS = ("loss", "lr", "img_per_s", "data_wait_share", "grad_norm")


def default_dir(health_dir: Path) -> Path:
    """$SM_OUTPUT_DIR/tensorboard in a SageMaker job (the request's TensorBoardOutputConfig.LocalPath,
    contracts.container_paths), else beside the health files."""
    output = os.environ.get("SM_OUTPUT_DIR")
    return Path(output) / "tensorboard" if output else health_dir / "tensorboard"


class Board:
    """Scalars per logged step and the validation grid per checkpoint; a no-op off rank 0 or when off."""

    def __init__(self, directory: Path | None, rank: int):
        self._writer = None
        if directory is not None and rank == 0:
            from tensorboardX import SummaryWriter
            directory.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(directory), flush_secs=30)

    def figures(self, step: int, **values: float) -> None:
        if self._writer is None:
            return
        for name in SCALARS:
            value = values.get(name)
            if value is not None and np.isfinite(value):
                self._writer.add_scalar(f"train/{name}", float(value), step)

    def validation(self, step: int, grid: Image.Image) -> None:
        if self._writer is not None:
            self._writer.add_image("validation/grid", np.asarray(grid.convert("RGB")), step, dataformats="HWC")
            self._writer.flush()  # a checkpoint is where someone looks: show it now

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
