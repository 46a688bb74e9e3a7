"""A base for PretrainedModelUri: a local diffusers pipeline, or some of its folders, checked and
uploaded under `s3://<models bucket>/bases/<name>/` with `atelier-base.json` beside it (`atelier base add`).

atelier-base.json lists what was uploaded: the components found (each folder with its config), and
every file with its size and sha256. It is written last, so a prefix without it is an upload that
did not finish; a name that holds another base is refused, since jobs record the base they read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import boto3

from atelier.client import PipelineError
from core import aws
from core.start_training.pretrained import BASE_RECORD, BASES_PREFIX, COMPONENT_CONFIGS

BASE_SCHEMA = 1
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # one key segment PretrainedModelUri accepts


@dataclass(frozen=True)
class Added:
    uri: str
    record: dict[str, Any]  # atelier-base.json
    uploaded: bool  # False: the same base was there already


def components(root: Path) -> list[str]:
    """The pipeline folders under root that hold their config (vae/config.json, ...)."""
    return [name for name, config in COMPONENT_CONFIGS.items() if (root / name / config).is_file()]


def base_files(root: Path) -> list[Path]:
    """Every file of the base, sorted; hidden files and folders (.git, .cache) and an old record left out."""
    return sorted(p for p in root.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts)
                  and p.relative_to(root).as_posix() != BASE_RECORD)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(root: Path, name: str) -> list[str]:
    """The components of a folder that can be a base named `name`; PipelineError saying why not."""
    if not NAME_PATTERN.fullmatch(name):
        raise PipelineError(f"base name {name!r} must be letters, digits, '.', '_' and '-' (pass --name)")
    if not root.is_dir():
        raise PipelineError(f"{root} is not a folder")
    found = components(root)
    if not found:
        raise PipelineError(f"{root} is not a diffusers pipeline or part of one: no {', '.join(COMPONENT_CONFIGS)} "
                            "folder with its config (e.g. vae/config.json, scheduler/scheduler_config.json)")
    return found


def record_of(root: Path, name: str, uri: str, found: list[str]) -> dict[str, Any]:
    files = [{"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": sha256_of(p)}
             for p in base_files(root)]
    return {"schema_version": BASE_SCHEMA, "name": name, "uri": uri, "components": found,
            "model_index": (root / "model_index.json").is_file(), "files": files}


def add(models_bucket: str, root: Path, name: str, on_bytes: Callable[[int], None] | None = None,
        on_start: Callable[[int], None] | None = None) -> Added:
    """Upload the folder as base `name` (`on_start`: total bytes, once; `on_bytes`: per chunk sent)."""
    found = check(root, name)
    prefix = f"{BASES_PREFIX}{name}/"
    uri = f"s3://{models_bucket}/{prefix}"
    record = record_of(root, name, uri, found)
    existing = aws.read_json_if_exists(models_bucket, prefix + BASE_RECORD)
    if existing == record:
        return Added(uri, record, uploaded=False)
    if existing is not None:
        raise PipelineError(f"{uri} holds another base (its {BASE_RECORD} lists other files): choose another --name; "
                            "jobs record the base they read, so a base is never replaced")
    if on_start:
        on_start(sum(f["size"] for f in record["files"]))
    s3 = boto3.client("s3")
    for entry in record["files"]:
        s3.upload_file(str(root / entry["path"]), models_bucket, prefix + entry["path"], Callback=on_bytes)
    wanted = {prefix + f["path"] for f in record["files"]}
    for leftover in [o["Key"] for o in aws.list_objects(models_bucket, prefix) if o["Key"] not in wanted]:
        aws.delete_object(models_bucket, leftover)  # of an upload that did not finish: the prefix is this base alone
    aws.write_object(models_bucket, prefix + BASE_RECORD, json.dumps(record, indent=1).encode(), "application/json")
    return Added(uri, record, uploaded=True)
