"""Checkpoints: everything a job needs to continue exactly where another stopped.

    <checkpoint-dir>/
      step-00000200/
        unet/                   the denoiser: config.json + diffusion_pytorch_model.safetensors (full weights,
                                loadable with its class's from_pretrained, UNet2DConditionModel or the
                                family's transformer; of a LoRA run, the adapter's parameters alone, by
                                parameter name: trainer/models/lora.py)
        ema_unet/               the EMA weights, the same way (when EMA is on)
        training_state.pt       the caller's state (trainer.jobs.train: RunState.to_dict(), trainer/runtime/run_state.py:
                                step, stage, args, loss history, corrupt samples, shards seen, draws), the
                                optimizer (keyed by parameter name), lr scheduler, EMA counters
        rng-rank<r>.pt          rank r's torch / CUDA / Python / NumPy RNG states
        manifest.json           {"format": 1, "step": 200, "files": [{"path", "size", "sha256"}, ...]}
                                for every file above (every rank's RNG file), written last
      latest                    "step-00000200": a hint for people, never read by resume

A checkpoint is complete when its manifest verifies: every file it lists is there with its size and
sha256 (files it does not list are ignored). SageMaker syncs the checkpoint dir to S3 file by file
while training and restores whatever reached S3 into the next job, in no promised order, so `latest`,
a half-uploaded step directory or even a `.tmp-step-…` one can come back; the manifest is the only
thing trusted. A checkpoint is first copied off the training state (`take_snapshot`, on every rank at the same
step: every rank's RNG bytes are gathered), then written under `.tmp-step-…` with its manifest and
renamed into place (`write_snapshot`, no collective), either at once (`save_checkpoint`) or in a
thread while training goes on (trainer/runtime/checkpoint_writer.py). `--resume latest` takes the newest step
directory that verifies and logs each newer one it skips (those written before manifests existed are
skipped as "no manifest"); pruning keeps the newest `keep` step directories, the newest verified one
and the one just written.
"""

import copy
import hashlib
import io
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import diffusers
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainer.runtime.distributed import (Processes, barrier, from_rank_zero, full_model_state, full_optimizer_state,
                                         load_full_state, trainable_names)
from trainer.runtime.ema import EMA
from trainer.runtime.health import log

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 4 * 1024 * 1024  # bytes per read: few calls over GBs of weights, little memory held
STEP_DIR = re.compile(r"step-(\d+)")
ENTRY_KEYS = {"path", "size", "sha256"}
REQUIRED_FILES = ("training_state.pt", f"unet/{WEIGHTS_NAME}")  # what load_checkpoint cannot do without


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from, with the reason."""


def rng_states() -> dict:
    """This process's generators: the CPU's and its own GPU's only (the device `distributed.setup` set), so a
    rank's file restores on a host with any number of GPUs."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    cuda = states["cuda"]
    if isinstance(cuda, list):  # files written before: every visible GPU's state; this process's is its own index
        cuda = cuda[torch.cuda.current_device()] if cuda and torch.cuda.is_available() and torch.cuda.current_device() < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def save_unet(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """A denoiser directory from its config (with `_class_name`, take_snapshot's) and full weights
    (works for sharded models too)."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {key: value for key, value in config.items() if not key.startswith("_")}
    config_json = {"_class_name": config.get("_class_name", "UNet2DConditionModel"),
                   "_diffusers_version": diffusers.__version__, **fields}
    (directory / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / WEIGHTS_NAME)


# ---------------------------------------------------------------- manifest


def sha256_of(path: Path, sync: bool = False) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file read in HASH_CHUNK pieces; `sync` also fsyncs it."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as stream:
        while chunk := stream.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:  # the manifest vouches for these bytes: have them on disk before it exists
            os.fsync(stream.fileno())
    return size, digest.hexdigest()


def file_entry(directory: Path, relative: str) -> dict:
    """One manifest entry for a file just written (fsynced as it is hashed)."""
    size, sha256 = sha256_of(directory / relative, sync=True)
    return {"path": relative, "size": size, "sha256": sha256}


def write_manifest(directory: Path, step: int, entries: list[dict]) -> None:
    """manifest.json for every file in `directory`; `entries` are files already hashed (other ranks')."""
    files = {entry["path"]: entry for entry in entries}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative not in files:
            files[relative] = file_entry(directory, relative)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": [files[name] for name in sorted(files)]}
    write_atomically(directory / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")


def listed_files(directory: Path) -> list[dict]:
    """The manifest's file entries, or CheckpointError saying why there are none to trust."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise CheckpointError("no manifest") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"unreadable manifest: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"manifest format {found!r}, this trainer reads {MANIFEST_FORMAT}")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(isinstance(entry, dict) and ENTRY_KEYS <= entry.keys() for entry in files):
        raise CheckpointError("unreadable manifest: no list of {path, size, sha256}")
    listed = {entry["path"] for entry in files}
    for required in REQUIRED_FILES:  # a manifest listing less would verify and then fail to load
        if required not in listed:
            raise CheckpointError(f"manifest does not list {required}")
    return files


def verify_checkpoint(directory: Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is there with its size and sha256."""
    if not directory.is_dir():
        raise CheckpointError("not a directory")
    files = listed_files(directory)
    for entry in files:  # sizes first: a missing or cut-off file is found without hashing GBs
        path = directory / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"missing {entry['path']}")
        if path.stat().st_size != entry["size"]:
            raise CheckpointError(f"size mismatch {entry['path']}: {path.stat().st_size} bytes, manifest says {entry['size']}")
    for entry in files:
        try:
            _, sha256 = sha256_of(directory / entry["path"])
        except OSError as error:
            raise CheckpointError(f"unreadable {entry['path']}: {error}") from None
        if sha256 != entry["sha256"]:
            raise CheckpointError(f"sha256 mismatch {entry['path']}")


def step_directories(checkpoint_dir: Path) -> list[Path]:
    """The step-N directories, newest first (a `.tmp-step-…` one was never finished and never counts)."""
    found = [path for path in checkpoint_dir.glob("step-*") if path.is_dir() and STEP_DIR.fullmatch(path.name)]
    return sorted(found, key=lambda path: int(STEP_DIR.fullmatch(path.name)[1]), reverse=True)


def first_verified(directories: list[Path], trusted: Path | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The first directory that verifies (`trusted` counts without hashing) and (directory, reason) for each before it."""
    skipped = []
    for directory in directories:
        if directory == trusted:
            return directory, skipped
        try:
            verify_checkpoint(directory)
        except CheckpointError as error:
            skipped.append((directory, str(error)))
            continue
        return directory, skipped
    return None, skipped


# ---------------------------------------------------------------- save, prune, choose, load


@dataclass
class Snapshot:
    """One checkpoint's contents, copied off the training state: writing it may overlap later steps."""
    step: int
    config: dict  # the denoiser's, with its `_class_name`
    weights: dict[str, torch.Tensor]  # full, on the CPU (complete on rank 0)
    ema_weights: dict[str, torch.Tensor] | None
    training_state: dict  # the caller's state, the optimizer, lr scheduler and EMA counters
    rng: list[bytes]  # every rank's RNG states as torch.save bytes, in rank order


def take_snapshot(processes: Processes, unet, optimizer, lr_schedule, ema: EMA | None, state: dict) -> Snapshot:
    """The checkpoint of this moment, on the CPU (every rank calls it: the full state dicts and the
    RNG gather are collectives). Nothing in it aliases what the next steps change."""
    weights, optimizer_state = full_model_state(unet), full_optimizer_state(unet, optimizer)
    ema_weights = ema.full_weights() if ema else None
    if processes.device.type == "cpu":  # the CPU "copies" of a CPU model are its live tensors
        weights, optimizer_state, ema_weights = owned((weights, optimizer_state, ema_weights))
    rng = io.BytesIO()
    torch.save(rng_states(), rng)
    training_state = copy.deepcopy({**state, "lr_scheduler": lr_schedule.state_dict(),
                                    "ema": ema.state_dict() if ema else None, "adapter": adapter_shape(unet)})
    config = {**dict(unet.config), "_class_name": model_class_name(unet)}
    return Snapshot(state["step"], config, weights, ema_weights,
                    {**training_state, "optimizer": optimizer_state}, every_rank(rng.getvalue()))


def describe_adapter(shape: dict | None) -> str:
    return "no adapter (a whole model)" if shape is None else f"rank {shape['rank']}, alpha {shape['alpha']} on {', '.join(shape['targets'])}"


def adapter_config(denoiser: torch.nn.Module):
    """The LoRA adapter (peft's LoraConfig) the denoiser trains through, or None when it trains in full."""
    return denoiser.peft_config.get("default") if getattr(denoiser, "_hf_peft_config_loaded", False) else None


def adapter_shape(denoiser: torch.nn.Module) -> dict | None:
    """The LoRA adapter the denoiser trains through, as a checkpoint records it (rank, alpha, targets: what
    its weights mean), or None for a whole model."""
    config = adapter_config(denoiser)
    if config is None:
        return None
    return {"rank": config.r, "alpha": config.lora_alpha, "targets": sorted(config.target_modules)}


def model_class_name(model) -> str:
    """The diffusers class under DDP's, FSDP's or torch.compile's wrapper: what from_pretrained reads."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return type(model).__name__


def owned(tree):
    """`tree` with every tensor cloned (dicts, lists and tuples rebuilt, the rest kept)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: owned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(owned(value) for value in tree)
    return tree


def write_snapshot(checkpoint_dir: Path, processes: Processes, snapshot: Snapshot, keep: int) -> Path:
    """step-N/ from a snapshot, with no collective: safe in a thread beside training.

    Each host has its own checkpoint dir (SageMaker syncs every host's to the same S3 prefix): its
    first process writes its host's RNG files there and publishes step-N; rank 0 also writes the
    weights, the training state and the manifest, which vouches for every rank's RNG file (other
    hosts' by the sha256 of the bytes they write)."""
    name = f"step-{snapshot.step:08d}"
    tmp, final = checkpoint_dir / f".tmp-{name}", checkpoint_dir / name
    if processes.local_rank != 0:
        return final
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    host = range(processes.rank, processes.rank + processes.local_world_size)  # torchrun numbers a host's ranks in a row
    for rank in host:
        with (tmp / rng_name(rank)).open("wb") as stream:
            stream.write(snapshot.rng[rank])
            stream.flush()
            os.fsync(stream.fileno())  # vouched for by rank 0's manifest, maybe on another host
    if processes.rank == 0:
        save_unet(tmp / "unet", snapshot.config, snapshot.weights)
        if snapshot.ema_weights is not None:
            save_unet(tmp / "ema_unet", snapshot.config, snapshot.ema_weights)
        torch.save(snapshot.training_state, tmp / "training_state.pt")
        elsewhere = [{"path": rng_name(rank), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                     for rank, data in enumerate(snapshot.rng) if rank not in host]
        write_manifest(tmp, snapshot.step, elsewhere)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if processes.rank == 0:
        write_atomically(checkpoint_dir / "latest", name)
    prune_checkpoints(checkpoint_dir, keep, written=final)
    return final


def rng_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def save_checkpoint(checkpoint_dir: Path, processes: Processes, unet, optimizer, lr_schedule, ema: EMA | None,
                    state: dict, keep: int) -> Path:
    """Write step-N/ now (every rank takes part); `state` is the run's plain data, its "step" among it,
    rank 0's saved (the caller gathers it). trainer/runtime/checkpoint_writer.py writes it in the background."""
    snapshot = take_snapshot(processes, unet, optimizer, lr_schedule, ema, state)
    final = write_snapshot(checkpoint_dir, processes, snapshot, keep)
    barrier()
    return final


def every_rank(item):
    """Every rank's `item`, in rank order (a collective)."""
    if not dist.is_initialized():
        return [item]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, item)
    return everyone


def write_atomically(path: Path, text: str) -> None:
    # fsynced before the rename, so a crash leaves the old file or the whole new one
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def prune_checkpoints(checkpoint_dir: Path, keep: int, written: Path | None = None) -> None:
    """Delete all step directories but the newest `keep`, the newest verified one and `written`, and unfinished ones.

    `written` is the checkpoint just written, trusted without hashing, so only directories newer
    than it (leftovers a resumed job found) are verified. A `.tmp-step-…` is never resumed from.
    """
    newest_first = step_directories(checkpoint_dir)
    verified, _ = first_verified(newest_first, trusted=written)
    for old in newest_first[keep:]:
        if old not in (verified, written):
            shutil.rmtree(old)
    for unfinished in checkpoint_dir.glob(".tmp-step-*"):
        if unfinished.is_dir():
            shutil.rmtree(unfinished)


def checkpoint_to_resume(resume: str, checkpoint_dir: Path | None) -> Path | None:
    """The verified checkpoint `--resume` asks for, or None to start from step 0 (every rank calls it).

    `latest`: the newest step directory whose manifest verifies; one `checkpoint_skipped` log line
    for each newer one, with the reason. `latest` the file is not read, and checkpoints written
    before manifests existed are skipped ("no manifest"). A named directory that does not verify
    raises CheckpointError before anything is loaded. Rank 0 alone hashes and decides; every rank
    gets its answer, so all load the same checkpoint.
    """
    chosen, error = from_rank_zero(lambda: choose_checkpoint(resume, checkpoint_dir))
    if error:
        raise CheckpointError(error)
    return Path(chosen) if chosen else None


def choose_checkpoint(resume: str, checkpoint_dir: Path | None) -> tuple[str | None, str | None]:
    """(the checkpoint to resume or None, None) or (None, why the named one cannot be): rank 0's decision."""
    if resume == "none":
        return None, None
    if resume != "latest":
        try:
            verify_checkpoint(Path(resume))
        except CheckpointError as error:
            return None, f"--resume {resume}: {error}"
        return resume, None
    if checkpoint_dir is None or not checkpoint_dir.is_dir():
        return None, None
    chosen, skipped = first_verified(step_directories(checkpoint_dir))
    for directory, reason in skipped:
        log(0, event="checkpoint_skipped", checkpoint=str(directory), reason=reason)
    return (str(chosen) if chosen else None), None


def load_checkpoint(path: Path, processes: Processes, unet, optimizer, lr_schedule, ema: EMA | None) -> dict:
    """Put the weights, optimizer, scheduler, EMA and this rank's RNG back; return the state the caller saved.

    Every rank calls it. A checkpoint without EMA weights restarts the average from its weights;
    one without this rank's RNG file (more processes than saved it) keeps the fresh RNG.
    """
    weights = load_file(path / "unet" / WEIGHTS_NAME)
    trains = trainable_names(unet) or {name for name, _ in unet.named_parameters()}
    if not trains <= set(weights) or trainable_names(unet) is not None and set(weights) != trains:
        raise CheckpointError(f"{path} holds other weights than this run trains: a LoRA adapter's and a whole model's "
                              "do not resume each other, nor adapters on other targets")
    state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    saved, current = state.pop("adapter", "unrecorded"), adapter_shape(unet)
    if saved != "unrecorded" and saved != current:  # the same names, but scaled or placed otherwise
        raise CheckpointError(f"{path} trained an adapter of {describe_adapter(saved)}, this run one of "
                              f"{describe_adapter(current)}: resume with the same --lora-rank and --lora-alpha")
    load_full_state(unet, optimizer, weights, state.pop("optimizer"))
    lr_schedule.load_state_dict(state.pop("lr_scheduler"))
    # The next step's rate by this job's schedule, not the saved one: a later stage's job resumes the optimizer of
    # the stage before it, whose own schedule set that rate (the new stage's warm-up would never apply).
    lr_schedule.last_epoch -= 1
    lr_schedule.step()
    ema_state = state.pop("ema", None)
    if ema is not None:
        if ema_state and (path / "ema_unet" / WEIGHTS_NAME).is_file():
            ema.load_state_dict(ema_state, load_file(path / "ema_unet" / WEIGHTS_NAME))
        else:
            ema.load_state_dict({"decay": ema.decay, "updates": 0}, weights)
    rng_file = path / rng_name(processes.rank)
    if rng_file.is_file():
        restore_rng_states(torch.load(rng_file, weights_only=False))
    return state
