"""What the mixed-precision tests share, on a CPU (tests/trainer/test_mixed_precision.py) and on a GPU
(tests/gpu/): micro-batches, the numerics a run takes, a Trainee as trainer/jobs/train.py builds one, steps
of trainer.jobs.step.train_step, and how far two runs ended apart.

Imports torch, diffusers and the trainer's step only: the GPU machine has no boto3 or moto (tests/gpu/README.md).
"""

import contextlib
import copy
import itertools
from typing import Callable

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.jobs.step import StepSettings, Trainee, train_step
from trainer.objectives import numerics
from trainer.runtime.distributed import Processes
from trainer.runtime.ema import EMA
from trainer.runtime.health import Window
from trainer.speed.cuda_graphs import GraphedBackward
from trainer.speed.master_weights import MasterWeights

LEARNING_RATE = 1e-4  # trainer.jobs.train's default
SETTINGS = StepSettings(seed=11)  # one micro-batch a step, clipped to norm 1: the trainer's defaults


def micro_batches(count: int, side: int, size: int = 2) -> list[dict]:
    """`count` micro-batches of `size` random images of `side` px (pixels in [-1, 1]), as the loader yields them."""
    generator = torch.Generator().manual_seed(side)
    return [{"pixel_values": torch.rand(size, 3, side, side, generator=generator) * 2 - 1,
             "caption": [f"a {('red', 'blue')[index % 2]} circle, picture {number}" for index in range(size)],
             "key": [f"k{number}-{index}" for index in range(size)], "corrupt": [], "shard": ["s.tar"],
             "source": [("p", "cc-by-4.0")] * size} for number in range(count)]


@contextlib.contextmanager
def numerics_of(models, device: torch.device, bf16: bool):
    """The trainer's numerics on `device` while inside: bf16 autocast with the frozen parts in bf16 (what a GPU
    job runs, trainer/objectives/numerics.py and Models.frozen_to), or fp32 throughout (TF32 off: the reference)."""
    with pytest.MonkeyPatch.context() as patch, (exact_fp32() if device.type == "cuda" and not bf16
                                                 else contextlib.nullcontext()):
        patch.setattr(numerics, "AUTOCAST_DEVICE_TYPES", frozenset({device.type} if bf16 else ()))
        for frozen in (models.vae, *models.text_encoders):
            frozen.to(device, torch.bfloat16 if bf16 else torch.float32)
        yield


@contextlib.contextmanager
def exact_fp32():
    """TF32 off for CUDA matmuls and convolutions while inside, by torch's fp32_precision settings (torch 2.11 on
    the GPU machine no longer reads the older allow_tf32 flags back)."""
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    before = [setting.fp32_precision for setting in settings]
    for setting in settings:
        setting.fp32_precision = "ieee"
    try:
        yield
    finally:
        for setting, value in zip(settings, before):
            setting.fp32_precision = value


def trainee_of(unet: torch.nn.Module, step_model=None, graphed: bool = False,
               weights: MasterWeights | None = None) -> Trainee:
    """A Trainee as trainer.jobs.train builds one for one process: AdamW (fused on a GPU) at a constant rate, the
    EMA; `step_model` what the loss calls (torch.compile of the UNet: --compile), `graphed` its forward and
    backward from CUDA graphs (--cuda-graphs), `weights` bf16 weights whose fp32 masters the optimizer steps."""
    step_model = unet if step_model is None else step_model
    trained = unet if weights is None else weights.masters
    fused = next(trained.parameters()).is_cuda or None
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1.0, fused=fused)  # the schedule sets the rate
    if weights is not None:
        weights.track(optimizer)
    graphs = GraphedBackward(step_model, list(trained.parameters())) if graphed else None
    return Trainee(trained, unet, step_model, optimizer, LambdaLR(optimizer, lambda steps_done: LEARNING_RATE),
                   EMA(trained.named_parameters(), 0.9999), graphs)


def trained(models, start: torch.nn.Module, batches: list[dict], steps: int, device: torch.device, bf16: bool,
            build: Callable[[torch.nn.Module], Trainee] = trainee_of) -> tuple[list[float], Trainee]:
    """`steps` train_steps of a copy of `start` over `batches` (cycled), in bf16 autocast or fp32, its Trainee
    made by `build`: each step's loss, and the Trainee (its `unet` the weights the optimizer stepped: with master
    weights, the masters)."""
    unet = copy.deepcopy(start)
    stream, window, processes = itertools.cycle(batches), Window(), Processes(0, 1, 0, 1, device, None)
    with numerics_of(models, device, bf16):
        trainee = build(unet)
        outcomes = [train_step(trainee, models, stream, window, SETTINGS, step, processes)
                    for step in range(1, steps + 1)]
    assert all(outcome.finite for outcome in outcomes)
    return [outcome.loss.item() for outcome in outcomes], trainee


def loss_gap(losses: list[float], reference: list[float]) -> float:
    """The largest difference between two loss curves, step by step, relative to the reference's loss."""
    return max(abs(ours - theirs) / abs(theirs) for ours, theirs in zip(losses, reference, strict=True))


@torch.no_grad()
def weight_drift(trained: torch.nn.Module, reference: torch.nn.Module, start: torch.nn.Module) -> float:
    """|trained - reference| / |reference - start| over all parameters (fp32): how far two runs' weights ended
    apart, as a share of how far training moved the reference's. 0: the same weights; 1: as far apart as training
    moved them (a run whose weights never moved)."""
    flat = (lambda module: torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()]))
    ours, theirs, initial = flat(trained), flat(reference), flat(start)
    return ((ours - theirs).norm() / (theirs - initial).norm()).item()
