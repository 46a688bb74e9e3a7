"""One process or many: torchrun's environment in, the process group and the wrapped UNet out.

- Backend: NCCL on GPUs (over EFA where the instance has it: trainer/runtime/cluster.py), gloo on CPUs.
  Not SMDDP: its last release (2.5.0) is built for PyTorch 2.4.1 and supports P4d/P4de only, while
  this image runs PyTorch 2.7 on any GPU type (docs/trainer.md, "Multi-node on SageMaker").
- `ddp` (default): DistributedDataParallel, every rank holds the whole UNet and optimizer.
- `fsdp`: FSDP2 `fully_shard` per UNet block and on the whole, so parameters, gradients and
  optimizer state are sharded across ranks (for SDXL-size models); bf16 compute on GPUs.
Checkpoints hold full (unsharded) state dicts either way, so a job can resume with the other
strategy or another number of processes.
"""

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
TRAINABLE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


@dataclass(frozen=True)
class Processes:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None for a single process


def collective_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def setup() -> Processes:
    """This process's place: one per GPU under torchrun, else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = None
    if world_size > 1:
        backend = collective_backend()
        dist.init_process_group(backend)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return Processes(int(os.environ.get("RANK", 0)), world_size, local_rank,
                     int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device, backend)


def wrap(unet: torch.nn.Module, processes: Processes, strategy: str) -> torch.nn.Module:
    """The module the training step calls: the UNet itself, under DDP, or sharded in place by FSDP."""
    if processes.world_size == 1:
        return unet
    if strategy == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if processes.device.type == "cuda" else MixedPrecisionPolicy()
        for block in shard_units(unet):
            fully_shard(block, mp_policy=policy)
        fully_shard(unet, mp_policy=policy)
        return unet
    device_ids = [processes.device.index] if processes.device.type == "cuda" else None
    return DistributedDataParallel(unet, device_ids=device_ids, gradient_as_bucket_view=True)


def shard_units(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP shards one by one (each gathered only while it runs): a UNet's down, mid and up blocks,
    a transformer's (SD3's, PixArt's) transformer blocks, and Flux's single-stream blocks after its double-stream ones."""
    if hasattr(denoiser, "down_blocks"):
        return [*denoiser.down_blocks, denoiser.mid_block, *denoiser.up_blocks]
    return [*denoiser.transformer_blocks, *getattr(denoiser, "single_transformer_blocks", ())]


def gradient_sync(model: torch.nn.Module, sync: bool):
    """A context that skips the gradient all-reduce on micro-batches before the last of a step."""
    if sync:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return _resume_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _resume_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_rank_zero(compute: Callable[[], object]) -> object:
    """`compute()` run on rank 0 alone, its (picklable) result given to every rank: work all ranks need the answer
    of, but one can do (reading a base's files once, not once a rank)."""
    if not dist.is_initialized():
        return compute()
    result = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def mean(values: torch.Tensor) -> torch.Tensor:
    """The element-wise mean of `values` over all ranks."""
    if dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values


def all_finite(*values: torch.Tensor) -> bool:
    """Whether every value is finite on every rank: all ranks get the same answer (one device sync)."""
    bad = sum((~torch.isfinite(value)).float() for value in values)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return bad.item() == 0


def union(items: set) -> set:
    """The union of every rank's set."""
    if not dist.is_initialized():
        return set(items)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, items)
    return set().union(*everyone)


def replicas_agree(module: torch.nn.Module) -> bool:
    """Whether every rank holds the same weights, a data-parallel job's invariant (DDP's ranks apply the same
    averaged gradients, so the same bits): one fingerprint a rank, each parameter's sum weighted by its place."""
    with torch.no_grad():
        fingerprint = sum(float(parameter.double().sum()) * place for place, parameter in enumerate(module.parameters(), 1))
    return len(union({fingerprint})) == 1


def trainable_names(unet: torch.nn.Module) -> set[str] | None:
    """The names of the parameters that train when some are frozen (a LoRA adapter's); None when all train."""
    named = dict(unet.named_parameters())
    trainable = {name for name, parameter in named.items() if parameter.requires_grad}
    return None if len(trainable) == len(named) else trainable


def full_model_state(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What trains of the UNet, whole on the CPU (a collective under FSDP; complete on rank 0): all its weights
    and buffers, or with some parameters frozen the trainable ones alone (a LoRA adapter's; the base is
    --pretrained's)."""
    trainable = trainable_names(unet)
    if trainable is None:
        return get_model_state_dict(unet, options=FULL)
    return {name: tensor for name, tensor in get_model_state_dict(unet, options=TRAINABLE).items() if name in trainable}


def full_optimizer_state(unet: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name (a collective under FSDP; complete on rank 0)."""
    return get_optimizer_state_dict(unet, optimizer, options=FULL)


def load_full_state(unet: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optimizer_state: dict) -> None:
    """Full state dicts (full_model_state's) back into a plain, DDP or FSDP-sharded UNet and its optimizer (every
    rank calls it)."""
    options = StateDictOptions(full_state_dict=True, strict=trainable_names(unet) is None)
    set_model_state_dict(unet, weights, options=options)
    set_optimizer_state_dict(unet, optimizer, optimizer_state, options=options)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
