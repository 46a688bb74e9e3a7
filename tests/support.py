"""What tests share besides fixtures: paths, the local names of the stack, events from events/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EVENTS = REPO / "events"
ACCOUNT, REGION, STACK = "123456789012", "us-east-1", "atelier"
# The template's image parameters have no defaults (AWS runs ECR images only); the local SageMaker
# runs trainer/ from this checkout for any image.
IMAGES = {"TrainingImageUri": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/atelier-trainer:test",
          "InferenceImageUri": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/atelier-trainer:test"}


def load_event(name: str) -> dict[str, Any]:
    """An event from events/, by file name without `.json`."""
    return json.loads((EVENTS / f"{name}.json").read_text())


def quick_training() -> dict[str, str]:
    """samconfig.toml [local]'s autoencoder and training parameters with a few steps each: for the e2e
    tests that need a model to flow through the chain, not one that draws its prompts."""
    from atelier.local.template import load_overrides
    overrides = load_overrides(REPO / "samconfig.toml", "local")
    quick = {"TrainingQuota": "2", "ShardMaxSamples": "8"}  # 16 pictures make two shards, one job
    for name, steps in (("AutoencoderHyperparameters", "20"), ("TrainingHyperparameters", "20")):
        hyperparameters = json.loads(overrides[name])
        quick[name] = json.dumps({**hyperparameters, "steps": steps, "checkpoint-every": "10", "log-every": "10"})
    return quick
