"""One optimizer step of the UNet, the step trainer/jobs/train.py runs and bench/train_timing.py times.

A step: for each micro-batch the diffusion loss (trainer/objectives/diffusion.py: noise, timesteps, target,
noise offset, min-SNR weighting) from that micro-batch's own seeded generator (forward and backward on the
family's attention kernels, trainer/models/families.py training_attention), its backward scaled
by 1 / micro-batches (the gradient all-reduce on the last alone; the UNet's part replayed from a
CUDA graph with `Trainee.graphs`, the draws still made eagerly); then gradient clipping, one
finiteness check over every rank, AdamW and the EMA when it is finite (the weights stay as they
were when not, on every rank), and the learning-rate schedule's step either way.
"""

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from trainer.models.bundle import Models
from trainer.models.families import training_attention
from trainer.objectives.diffusion import diffusion_loss, noised_inputs
from trainer.objectives.numerics import step_generator
from trainer.runtime import distributed
from trainer.runtime.ema import EMA
from trainer.runtime.health import Window
from trainer.speed.cuda_graphs import GraphedBackward


@dataclass
class Trainee:
    """The UNet being trained and what updates it."""
    unet: torch.nn.Module  # its trainable parameters are clipped, stepped and averaged
    model: torch.nn.Module  # the UNet under DDP / FSDP (or itself): its gradient-sync switch
    step_model: Callable  # what the loss calls: `model`, or torch.compile of it
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    ema: EMA | None
    graphs: GraphedBackward | None = None  # the UNet's forward and backward from CUDA graphs (trainer/speed/cuda_graphs.py)
    trained: list[tuple[str, torch.nn.Parameter]] = field(init=False, repr=False)

    def __post_init__(self):
        # every parameter, or with a frozen base a LoRA adapter's alone (trainer/models/lora.py); listed once
        self.trained = [(name, parameter) for name, parameter in self.unet.named_parameters() if parameter.requires_grad]


@dataclass(frozen=True)
class StepSettings:
    """The step's hyperparameters; the defaults are trainer.jobs.train's."""
    seed: int = 0
    gradient_accumulation: int = 1
    max_grad_norm: float = 1.0
    noise_offset: float = 0.0
    snr_gamma: float | None = None
    sync_every_micro_batch: bool = False  # the all-reduce on every micro-batch: a benchmark lever, never a job's

    @classmethod
    def from_args(cls, args) -> "StepSettings":
        return cls(args.seed, args.gradient_accumulation, args.max_grad_norm, args.noise_offset, args.snr_gamma)


@dataclass
class StepOutcome:
    loss: torch.Tensor  # the mean over the micro-batches, detached, on the device
    grad_norm: torch.Tensor  # before clipping
    learning_rate: float  # the rate this step used
    finite: bool  # False: a NaN or inf on some rank; no rank changed its weights
    batches: list[dict]  # the micro-batches, for the caller's counts


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor (FSDP returns the gradient norm as a replicated DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_step(trainee: Trainee, models: Models, batches: Iterator[dict], window: Window, settings: StepSettings,
               step: int, processes: distributed.Processes) -> StepOutcome:
    """Step `step` (1-based) on the next `gradient_accumulation` micro-batches; `window` counts their
    images, the time spent waiting for them and, when the step is finite, its loss and gradient norm."""
    device, accumulation = processes.device, settings.gradient_accumulation
    step_loss = torch.zeros((), device=device)  # a fresh tensor each step: never a compiled graph's output kept
    seen = []
    for micro in range(accumulation):
        batch = window.wait_for(batches)
        with distributed.gradient_sync(trainee.model, settings.sync_every_micro_batch or micro == accumulation - 1), \
                training_attention(models.family):
            generator = step_generator(settings.seed, step, processes.rank, micro, device)
            if trainee.graphs is None:
                loss = diffusion_loss(trainee.step_model, models, batch, device, generator, settings.noise_offset,
                                      settings.snr_gamma)
                (loss / accumulation).backward()
            else:
                noised = noised_inputs(models, batch, device, generator, settings.noise_offset, settings.snr_gamma)
                loss = trainee.graphs.loss_and_backward(noised, 1 / accumulation)
        step_loss += loss.detach() / accumulation
        window.images += len(batch["key"]) * processes.world_size
        seen.append(batch)
    grad_norm = whole(torch.nn.utils.clip_grad_norm_([p for _, p in trainee.trained], settings.max_grad_norm))
    learning_rate = trainee.optimizer.param_groups[0]["lr"]
    finite = distributed.all_finite(step_loss, grad_norm)  # a NaN on any rank skips the step on every rank
    if finite:
        trainee.optimizer.step()
        if trainee.ema is not None:
            trainee.ema.update(trainee.trained)
        window.loss_sum += step_loss.cpu()
        window.good_steps, window.grad_norm = window.good_steps + 1, grad_norm.item()
    if trainee.graphs is None:
        trainee.optimizer.zero_grad(set_to_none=True)
    else:
        trainee.graphs.zero_grad()  # in place: the graphs accumulate into these tensors
    trainee.lr_schedule.step()
    return StepOutcome(step_loss, grad_norm, learning_rate, finite, seen)
