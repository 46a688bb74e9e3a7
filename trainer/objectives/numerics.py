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
    """bf16 autocast on GPUs (trained weights stay fp32); full precision on CPU."""
    if device.type in AUTOCAST_DEVICE_TYPES:
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def step_generator(seed: int, step: int, rank: int, micro: int, device: torch.device) -> torch.Generator:
    """The generator for one micro-batch's random draws."""
    state = np.random.SeedSequence([seed, step, rank, micro]).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(state) & (2**63 - 1))
