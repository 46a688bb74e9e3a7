"""Building benchmark models with random weights."""

import contextlib

import torch


@contextlib.contextmanager
def drawn_in(dtype: torch.dtype):
    """Modules built inside get their parameters in `dtype` (torch's default dtype, restored after): a model drawn
    in the dtype it runs in never holds an fp32 copy beside it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
