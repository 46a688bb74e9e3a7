"""Checkpoints: everything a job needs to continue exactly where another stopped.

    <checkpoint-dir>/
      step-00000200/
        unet/                   config.json + diffusion_pytorch_model.safetensors (full weights,
                                loadable with UNet2DConditionModel.from_pretrained)
        ema_unet/               the EMA weights, the same way (when EMA is on)
        training_state.pt       step, stage, args, optimizer (keyed by parameter name), lr scheduler,
                                EMA counters, loss history, corrupt samples, shards seen
        rng-rank<r>.pt          rank r's torch / CUDA / Python / NumPy RNG states
      latest                    "step-00000200", written last

A checkpoint is written under `.tmp-step-…`, renamed into place, and only then named in `latest`
(itself replaced atomically): a job killed at any moment leaves `latest` naming a complete
checkpoint. The newest `keep` step directories are kept.
"""

import json
import os
import random
import shutil
from pathlib import Path

import diffusers
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.distributed import Processes, barrier, full_model_state, full_optimizer_state, load_full_state
from trainer.ema import EMA

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


def rng_states() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def save_unet(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """A UNet directory from its config and full weights (works for sharded models too)."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {key: value for key, value in config.items() if not key.startswith("_")}
    config_json = {"_class_name": "UNet2DConditionModel", "_diffusers_version": diffusers.__version__, **fields}
    (directory / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / WEIGHTS_NAME)


def save_checkpoint(checkpoint_dir: Path, processes: Processes, unet, optimizer, lr_schedule, ema: EMA | None,
                    state: dict, keep: int) -> Path:
    """Write step-N/ (every rank takes part; rank 0 writes all but its own RNG file)."""
    weights = full_model_state(unet)
    optimizer_state = full_optimizer_state(unet, optimizer)
    ema_weights = ema.full_weights() if ema else None
    name = f"step-{state['step']:08d}"
    tmp, final = checkpoint_dir / f".tmp-{name}", checkpoint_dir / name
    # Each host has its own checkpoint dir (SageMaker syncs every host's to the same S3 prefix): the
    # first process of each host makes and publishes step-N there, holding its host's RNG files.
    if processes.local_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_states(), tmp / f"rng-rank{processes.rank}.pt")
    if processes.rank == 0:
        save_unet(tmp / "unet", unet.config, weights)
        if ema:
            save_unet(tmp / "ema_unet", unet.config, ema_weights)
        torch.save({
            **state,
            "optimizer": optimizer_state,
            "lr_scheduler": lr_schedule.state_dict(),
            "ema": ema.state_dict() if ema else None,
        }, tmp / "training_state.pt")
    barrier()
    if processes.local_rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    if processes.rank == 0:
        write_atomically(checkpoint_dir / "latest", name)
    if processes.local_rank == 0:
        prune_checkpoints(checkpoint_dir, keep)
    barrier()
    return final


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prune_checkpoints(checkpoint_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories."""
    for old in sorted(checkpoint_dir.glob("step-*"))[:-keep]:
        shutil.rmtree(old)


def checkpoint_to_resume(resume: str, checkpoint_dir: Path | None) -> Path | None:
    """The checkpoint directory `--resume` asks for, or None to start from step 0."""
    if resume == "none":
        return None
    if resume != "latest":
        return Path(resume)
    marker = checkpoint_dir / "latest" if checkpoint_dir else None
    if marker is None or not marker.is_file():
        return None
    return checkpoint_dir / marker.read_text().strip()


def load_checkpoint(path: Path, processes: Processes, unet, optimizer, lr_schedule, ema: EMA | None) -> dict:
    """Put the weights, optimizer, scheduler, EMA and this rank's RNG back; return the training state.

    Every rank calls it. A checkpoint without EMA weights restarts the average from its weights;
    one without this rank's RNG file (more processes than saved it) keeps the fresh RNG.
    """
    weights = load_file(path / "unet" / WEIGHTS_NAME)
    state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    load_full_state(unet, optimizer, weights, state.pop("optimizer"))
    lr_schedule.load_state_dict(state.pop("lr_scheduler"))
    ema_state = state.pop("ema", None)
    if ema is not None:
        if ema_state and (path / "ema_unet" / WEIGHTS_NAME).is_file():
            ema.load_state_dict(ema_state, load_file(path / "ema_unet" / WEIGHTS_NAME))
        else:
            ema.load_state_dict({"decay": ema.decay, "updates": 0}, weights)
    rng_file = path / f"rng-rank{processes.rank}.pt"
    if rng_file.is_file():
        restore_rng_states(torch.load(rng_file, weights_only=False))
    return state
