"""What the trainer.jobs.train tests share: its log lines read back, the UNet's weights, the loss recorded."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.jobs import step
from trainer.runtime.distributed import Processes

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def events(lines: list[dict]) -> dict[str, dict]:
    """The setup events before the first step, by name (each shows once)."""
    setup = lines[:next((n for n, line in enumerate(lines) if "loss" in line), len(lines))]
    return {line["event"]: line for line in setup if "event" in line}


def losses(lines: list[dict]) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def unet_weights(directory: Path) -> dict:
    return load_file(directory / "diffusion_pytorch_model.safetensors")


@pytest.fixture
def record_batches(monkeypatch):
    """Every micro-batch the loss sees; `nan_steps` makes those calls' losses NaN (1-based call numbers)."""
    seen, real_loss = [], step.diffusion_loss

    def recording_loss(*args, **kwargs):
        seen.append(args[2])
        loss = real_loss(*args, **kwargs)
        if recording_loss.always_nan:
            return loss + float("nan")  # the loss alone, the gradients stay finite
        return loss * float("nan") if len(seen) in recording_loss.nan_steps else loss  # gradients NaN too

    recording_loss.nan_steps, recording_loss.always_nan = set(), False
    monkeypatch.setattr(step, "diffusion_loss", recording_loss)
    return seen, recording_loss
