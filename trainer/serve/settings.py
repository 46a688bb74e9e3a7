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
The deploy stage sets these from the recipe's serve.environment, and checks them with ServeSettings itself,
which lives in contracts/serve_environment.py for that reason.

Provenance (what every image says about its model): $ATELIER_MODEL_ID, $ATELIER_MANIFEST_DIGEST and
$ATELIER_ATTRIBUTION_URI, which DeployFunction sets in the model's container environment; the
manifest falls back to `manifest_digest` in the model's atelier-training.json, then each to "unknown".
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The settings are a contract (the deploy stage checks a serve.environment's values with the same parser)
from contracts.s3_layout import TRAINING_RECORD
from contracts.serve_environment import ServeSettings

__all__ = ["Provenance", "ServeSettings"]

UNKNOWN = "unknown"


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
        record = json.loads((model_dir / TRAINING_RECORD).read_text())
    except (OSError, ValueError):
        return None
    digest = record.get("manifest_digest") if isinstance(record, dict) else None
    return digest if isinstance(digest, str) and digest else None
