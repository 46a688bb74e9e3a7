"""The server's settings and provenance, read from the environment once at start.

Bounds (each bounds the time or memory one request can take): $SERVE_MAX_STEPS (200),
$SERVE_MAX_SIDE (2048), $SERVE_MAX_IMAGES (4), $SERVE_MAX_BODY_BYTES (65536),
$SERVE_MAX_PROMPT_CHARS (1000), $SERVE_MAX_GUIDANCE (50).

Speed levers (ServeSettings too; trainer/serve/levers.py says what each does, bench/serve_gpu.py
measures them): $SERVE_COMPILE (default; off|default|max-autotune) and $SERVE_CUDA_GRAPHS (1),
which on a GPU compile the UNet and VAE decoder and replay them as CUDA graphs, for the request
sizes in $SERVE_WARMUP_IMAGES (1; e.g. "1,2,4") before /ping answers 200 (other sizes run eagerly);
off by default: $SERVE_SCHEDULER (default|dpmpp), $SERVE_FUSE_QKV, $SERVE_CHANNELS_LAST,
$SERVE_BATCH_WINDOW_MS (0) and $SERVE_MAX_BATCH (8). With a batch window, requests that arrive
together run as one pipeline call; each still gets its own seeds' images, equal to what it gets
alone up to the last bits of bf16 arithmetic at another batch size.

$SERVE_CPU_THREADS caps torch's CPU threads (unset: every core), as the jobs' `cpu-threads`
hyperparameter does. Any other $SERVE_* name fails at start: a misspelt setting is not ignored.
The deploy stage sets these from the template's ServeEnvironment (contracts/serve_environment.py).

Provenance (what every image says about its model): $ATELIER_MODEL_ID, $ATELIER_MANIFEST_DIGEST and
$ATELIER_ATTRIBUTION_URI, which DeployFunction sets in the model's container environment; the
manifest falls back to `manifest_digest` in the model's atelier-training.json, then each to "unknown".
"""

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from contracts import serve_environment
from trainer.serve.levers import COMPILE_MODES, SCHEDULERS

UNKNOWN = "unknown"


@dataclass(frozen=True)
class ServeSettings:
    """The request bounds (each bounds the time or memory one request can take) and the speed levers."""

    max_steps: int = 200
    max_side: int = 2048
    max_images: int = 4
    max_body_bytes: int = 65536
    max_prompt_chars: int = 1000
    max_guidance: float = 50.0
    scheduler: str = "default"  # the saved pipeline's own
    fuse_qkv: bool = False
    channels_last: bool = False
    compile: str = "default"  # on a GPU only (trainer/serve/levers.py); bench/RESULTS.md has what each lever gave
    cuda_graphs: bool = True
    warmup_images: tuple[int, ...] = (1,)
    batch_window_ms: float = 0.0
    max_batch: int = 8
    cpu_threads: int | None = None  # torch's intra-op threads; None: torch's default (every core)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ServeSettings":
        """$SERVE_<FIELD> overrides each default; a value that does not parse, or a $SERVE_* name that is
        no field, fails at start."""
        names = {f"SERVE_{field.name.upper()}" for field in fields(cls)}
        strangers = sorted(name for name in environ if name.startswith(serve_environment.PREFIX) and name not in names)
        if strangers:
            raise ValueError(f"unknown server settings {strangers}; known: {', '.join(sorted(names))}")
        values = {}
        for field in fields(cls):
            name = f"SERVE_{field.name.upper()}"
            if name in environ:
                values[field.name] = _setting(field, name, environ[name].strip())
        return cls(**values)


CHOICES = {"scheduler": SCHEDULERS, "compile": COMPILE_MODES}
FLAGS = {"1": True, "true": True, "0": False, "false": False}


def _setting(field, name: str, text: str):
    if field.name in CHOICES:
        if text not in CHOICES[field.name]:
            raise ValueError(f"${name} must be one of {', '.join(CHOICES[field.name])}, got {text!r}")
        return text
    if field.type is bool:
        if text.lower() not in FLAGS:
            raise ValueError(f"${name} must be 1 or 0, got {text!r}")
        return FLAGS[text.lower()]
    if field.name == "warmup_images":
        return tuple(_positive(name, part, int) for part in text.split(","))
    return _positive(name, text, float if field.type is float else int, zero=field.name == "batch_window_ms")


def _positive(name: str, text: str, kind: type, zero: bool = False) -> int | float:
    """A positive number (or zero, where `zero`), else ValueError naming the variable."""
    wanted = f"${name} must be a {'non-negative' if zero else 'positive'} {kind.__name__}, got {text!r}"
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(wanted) from None
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(wanted)
    return value


@dataclass(frozen=True)
class Provenance:
    """What every image says about the model that made it."""

    model_id: str
    manifest: str
    attribution: str

    @classmethod
    def from_env(cls, model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> "Provenance":
        """The container environment's values; the manifest from atelier-training.json when it is unset."""
        return cls(
            model_id=environ.get("ATELIER_MODEL_ID") or UNKNOWN,
            manifest=environ.get("ATELIER_MANIFEST_DIGEST") or _recorded_manifest(Path(model_dir)) or UNKNOWN,
            attribution=environ.get("ATELIER_ATTRIBUTION_URI") or UNKNOWN,
        )


def _recorded_manifest(model_dir: Path) -> str | None:
    try:
        record = json.loads((model_dir / "atelier-training.json").read_text())
    except (OSError, ValueError):
        return None
    digest = record.get("manifest_digest") if isinstance(record, dict) else None
    return digest if isinstance(digest, str) and digest else None
