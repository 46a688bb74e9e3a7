"""Before models or data load, every rank shows that its device computes, that its memory is free and
that it reaches every other rank; a host that does not ends the job at once, with the reason.

Without it a bad GPU, memory held by a process left on the instance or a host cut off from its peers
shows up only after the models and the data loaded: as an out-of-memory error, NaNs, or a hang in
DDP's first all-reduce that lasts until NCCL's 10-minute timeout. The checks, run right after the
process group is made (trainer.runtime.distributed.setup):

- compute: a matrix product of known result on this rank's device;
- memory (CUDA only): at least `min_free_fraction` of the device's memory is free;
- collectives (several processes): an all-reduce to which rank r brings r + 1 in every element must
  give world * (world + 1) / 2 in every element, within `timeout_s` seconds. The bound is generous
  (the first collective also connects NCCL's ranks, and waits for the slowest rank to arrive): it
  catches a peer that never answers; the time taken goes to the log's start line.

A failed check writes `PreflightError: <host> rank <r>: <what failed>` to the failure file and
raises PreflightError. An all-reduce that never returns is ended at `timeout_s` by a watchdog
(trainer/runtime/watchdog.py: the stacks to the log, the same kind of reason, exit status 1).
"""

import time

import torch
import torch.distributed as dist

from trainer.runtime import cluster
from trainer.runtime.distributed import Processes
from trainer.runtime.health import write_failure
from trainer.runtime.watchdog import Watchdog

MATRIX_SIDE = 256  # ones @ ones gives exactly MATRIX_SIDE everywhere, in fp32 and TF32 alike
ALL_REDUCE_VALUES = 1 << 20  # 4 MiB of float32: several chunks on every link, still milliseconds


class PreflightError(RuntimeError):
    """This rank's device, memory or link to the other ranks failed a check at the job's start."""


def contribution(rank: int) -> float:
    """What `rank` brings to the all-reduce in every element."""
    return rank + 1.0


def check(processes: Processes, timeout_s: float, min_free_fraction: float) -> dict[str, float]:
    """Every check for this rank: what it measured, or PreflightError with the reason written."""
    where = f"{cluster.host_name()} rank {processes.rank}"
    figures = {}
    try:
        check_compute(processes.device)
        if processes.device.type == "cuda":
            figures["free_memory_fraction"] = check_memory(processes.device, min_free_fraction)
        if processes.world_size > 1:
            figures["all_reduce_s"] = check_all_reduce(processes, timeout_s, where)
    except PreflightError as error:
        write_failure(f"PreflightError: {where}: {error}")
        raise PreflightError(f"{where}: {error}") from None
    return figures


def check_compute(device: torch.device) -> None:
    """A matrix product on `device` gives its known result."""
    try:
        ones = torch.ones(MATRIX_SIDE, MATRIX_SIDE, device=device)
        right = torch.equal(ones @ ones, torch.full_like(ones, MATRIX_SIDE))
    except RuntimeError as error:  # a CUDA error: the device is lost, an uncorrectable ECC error, ...
        raise PreflightError(f"a matrix product on {device} failed: {error}") from error
    if not right:
        raise PreflightError(f"a matrix product on {device} gave wrong values")


def check_memory(device: torch.device, min_free_fraction: float) -> float:
    """The share of `device`'s memory that is free, at least `min_free_fraction`."""
    free, total = torch.cuda.mem_get_info(device)
    if free < min_free_fraction * total:
        raise PreflightError(f"{device} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, under the "
                             f"{min_free_fraction:.0%} needed (is another process using it?)")
    return round(free / total, 3)


def check_all_reduce(processes: Processes, timeout_s: float, where: str) -> float:
    """The seconds an all-reduce of known values took, when its result is right and within the bound."""
    world = processes.world_size
    expected = world * (world + 1) / 2
    values = torch.full((ALL_REDUCE_VALUES,), contribution(processes.rank), device=processes.device)
    deadline = Watchdog(timeout_s, lambda _: f"PreflightError: {where}: all_reduce did not finish within "
                                             f"{timeout_s:g} s (a peer is down or cannot be reached)")
    started = time.perf_counter()
    try:
        dist.all_reduce(values)
        wrong = values != expected
        wrong_count = int(wrong.sum())  # waits for the collective on a GPU
    except RuntimeError as error:  # the backend's own error: a peer closed the connection, ...
        raise PreflightError(f"all_reduce failed: {error}") from error
    finally:
        deadline.stop()
    seconds = time.perf_counter() - started
    if wrong_count:
        raise PreflightError(f"all_reduce gave {values[wrong][0].item():g}, expected {expected:g} "
                             f"({wrong_count} of {ALL_REDUCE_VALUES} values wrong)")
    if seconds > timeout_s:
        raise PreflightError(f"all_reduce took {seconds:.1f} s, over the {timeout_s:g} s bound")
    return round(seconds, 4)
