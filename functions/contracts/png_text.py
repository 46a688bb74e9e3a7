"""The text chunks of a PNG the endpoint serves (trainer/serve/protocol.py): its provenance and the settings
that made it, read back by whoever holds the image (`atelier generate`, the C2PA checks)."""

from __future__ import annotations

MODEL_ID = "atelier:model-id"
MANIFEST = "atelier:manifest"  # the digest of the manifest the model trained on
ATTRIBUTION = "atelier:attribution"
PROMPT = "atelier:prompt"
NEGATIVE_PROMPT = "atelier:negative-prompt"
SEED = "atelier:seed"
STEPS = "atelier:steps"
GUIDANCE = "atelier:guidance"
