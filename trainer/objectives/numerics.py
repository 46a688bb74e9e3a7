"""What every objective's micro-batch runs under: bf16 autocast on a GPU, and one seeded generator for all
of its random draws, so a step's loss is a pure function of (seed, step, rank, micro-batch).
"""

import contextlib

import numpy as np
import torch


# The device types whose steps run under bf16 autocast: GPUs'. A CPU runs in full precision, where bf16 buys
# nothing. The tests change it: the bf16 path on a CPU, an fp32 reference on a GPU (docs/testing.md, "GPU tests").
AUTOCAST_DEVICE_TYPES = frozenset({"cuda"})


def autocast(device: torch.device, cache: bool = True):
    """bf16 autocast on GPUs (trained weights stay fp32), with attention off cuDNN's kernels
    (without_cudnn_attention); full precision on CPU."""
    if device.type in AUTOCAST_DEVICE_TYPES:
        without_cudnn_attention()
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def without_cudnn_attention() -> None:
    """Scaled-dot-product attention on the flash and memory-efficient kernels, never cuDNN's, process-wide: with
    torch 2.11 and cuDNN 9.19, where SDPA picks cuDNN by default for Flux's attention, its backward gave NaN
    gradients (tiny-flux, 576 tokens) or a faulting kernel (FLUX.1's layout at 256 px) while flash and
    memory-efficient attention gave finite ones (bench/RESULTS.md, 2026-12-06); cuDNN was no faster for SD3 or
    PixArt (1.00x). Set before the first step's trace, so compiled and graphed steps keep it."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def step_generator(seed: int, step: int, rank: int, micro: int, device: torch.device) -> torch.Generator:
    """The generator for one micro-batch's random draws."""
    state = np.random.SeedSequence([seed, step, rank, micro]).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(state) & (2**63 - 1))
