"""Compile once per model shape: torch.compile's caches kept as one file per shape, loaded at start.

A compiled job spends minutes in Inductor before its first step (bench/RESULTS.md: 210 s for the
SD-2 UNet at 512). PyTorch's portable "mega-cache" (`torch.compiler.save_cache_artifacts` /
`load_cache_artifacts`: the FX graph, AOT autograd, Triton kernel and autotune caches in one blob)
lets a later process skip the code generation; Dynamo still traces the model.

A cache file is named by what decides the compiled graphs (`CacheKey.file_name`): the torch version,
the GPU, the UNet's architecture, the data source, resolution, micro-batch, channels-last and the
number of processes. Files are looked for in several directories (the lineage's checkpoints, which
CheckpointConfig carries from job to job, then the `compile-cache` channel shared across lineages,
which the pipeline fills from every lineage's checkpoints when a job ends) and written to the first.
Inductor's own keys still guard every entry, so a file that matches by name but not in content only
misses. A corrupt, truncated or foreign file falls back to compiling: the
job never fails because of its cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from contracts import s3_layout
from trainer.runtime.checkpoints import adapter_shape

SUFFIX = s3_layout.COMPILE_CACHE_SUFFIX
LINEAGE_FOLDER = s3_layout.COMPILE_CACHE.rstrip("/")  # below the checkpoint dir: CheckpointConfig syncs it
CHANNEL_ENV = "SM_CHANNEL_COMPILE_CACHE"  # the `compile-cache` channel: every lineage's files (core/start_training/compile_caches.py)


@dataclass(frozen=True)
class CacheKey:
    torch_version: str
    device: str  # the GPU's name ("NVIDIA H200"), or "cpu"
    unet: str  # digest of the UNet's architecture (its config without the bookkeeping keys)
    source: str  # "latent" or "image" (image shards compile the VAE encoder too)
    resolution: int
    batch: int  # images per micro-batch per process
    channels_last: bool
    world_size: int
    # what else changes the compiled graphs: "" for the whole model compiled without an adapter (the names files
    # had before), else "-regional" (a transformer family's blocks) and "-lora-r<rank>a<alpha>" (peft's layers)
    variant: str = ""

    @property
    def file_name(self) -> str:
        device = re.sub(r"[^a-z0-9]+", "-", self.device.lower()).strip("-")
        layout = "-cl" if self.channels_last else ""
        return (f"torch{self.torch_version.split('+')[0]}-{device}-unet{self.unet}-{self.source}"
                f"-r{self.resolution}-b{self.batch}{layout}-w{self.world_size}{self.variant}{SUFFIX}")


def architecture_digest(config: Mapping) -> str:
    """12 hex digits naming a model architecture: its config, less keys like `_name_or_path`."""
    shape = {key: value for key, value in dict(config).items() if not key.startswith("_")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_key(unet: torch.nn.Module, device: torch.device, source: str, resolution: int, batch: int,
              channels_last: bool, world_size: int, compiled: str = "whole") -> CacheKey:
    """The file of one shape's graphs; `compiled` is the job's compile mode (trainer/speed/regional_compile.py)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    adapter = adapter_shape(unet)
    variant = ("" if compiled == "whole" else f"-{compiled}") + (
        f"-lora-r{adapter['rank']}a{adapter['alpha']}" if adapter else "")
    return CacheKey(torch.__version__, name, architecture_digest(unet.config), source, resolution, batch,
                    channels_last, world_size, variant)


def cache_dirs(writable: Path | None, environ: Mapping[str, str] = os.environ) -> list[Path]:
    """Where cache files are looked for, the writable one first: then the shared channel, if any."""
    dirs = [writable] if writable is not None else []
    if environ.get(CHANNEL_ENV):
        dirs.append(Path(environ[CHANNEL_ENV]))
    return dirs


def load(dirs: Iterable[Path], keys: Iterable[CacheKey]) -> dict:
    """Load every cache file named by `keys` (the first directory holding it wins); what happened,
    for the log: `loaded` (file names), `missing` (names found nowhere), `unusable` (name: reason)."""
    dirs = list(dirs)
    outcome: dict = {"loaded": [], "missing": [], "unusable": {}}
    for name in dict.fromkeys(key.file_name for key in keys):
        path = next((directory / name for directory in dirs if (directory / name).is_file()), None)
        if path is None:
            outcome["missing"].append(name)
            continue
        try:
            info = torch.compiler.load_cache_artifacts(path.read_bytes())
        except Exception as error:  # any failure to read it only costs the compile it would have saved
            outcome["unusable"][name] = f"{type(error).__name__}: {error}"[:300]
            continue
        if info is None or not any(info.artifacts.values()):
            outcome["unusable"][name] = "no artifacts in it"
        else:
            outcome["loaded"].append(name)
    return outcome


def save(directory: Path | None, key: CacheKey, written_bytes: int | None = None) -> dict | None:
    """Write what this process compiled (and loaded) so far as `key`'s file, atomically: a job killed
    mid-write leaves the old file or none, never half of one. None when there is nothing to save;
    not written again when it is still the `written_bytes` long blob written last."""
    if directory is None:
        return None
    try:
        artifacts = torch.compiler.save_cache_artifacts()
    except Exception as error:  # never fail a job over its cache
        return {"file": key.file_name, "error": f"{type(error).__name__}: {error}"[:300]}
    if artifacts is None:
        return None
    blob, info = artifacts
    if len(blob) == written_bytes:  # nothing compiled since: CheckpointConfig need not upload it again
        return {"file": key.file_name, "bytes": len(blob), "unchanged": True}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / key.file_name
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(blob)
    partial.replace(path)
    return {"file": key.file_name, "bytes": len(blob), "artifacts": {kind: len(names) for kind, names in info.artifacts.items()}}


class JobCache:
    """One job's cache files: a key per phase (each phase is its own shape), loaded before the first
    step and written after each phase's first step, when that phase's graphs exist, and at each
    checkpoint, for the bucket shapes compiled since. Only rank 0 writes; every rank loads."""

    def __init__(self, directory: Path | None, keys: list[CacheKey], rank: int, environ: Mapping[str, str] = os.environ):
        self.directory, self.keys, self.rank = directory, keys, rank
        self.dirs = cache_dirs(directory, environ)
        self.phases_stepped: set[int] = set()
        self.written: dict[str, int] = {}  # file name -> bytes of the blob written last

    def first_step_of(self, phase: int) -> bool:
        """True once per phase, at this job's first step in it (a resumed job may start mid-phase)."""
        first = phase not in self.phases_stepped
        self.phases_stepped.add(phase)
        return first

    def load(self) -> dict:
        return {"dirs": [str(directory) for directory in self.dirs], **load(self.dirs, self.keys)}

    def save(self, phase: int) -> dict | None:
        if self.rank != 0:
            return None
        name = self.keys[phase].file_name
        saved = save(self.directory, self.keys[phase], self.written.get(name))
        if saved and "bytes" in saved:
            self.written[name] = saved["bytes"]
        return saved
