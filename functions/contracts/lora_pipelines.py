"""The diffusers pipeline classes a LoRA (`train: lora`, trainer/models/lora.py) can be trained on and served with.

The adapter is served by the base's pipeline (`load_lora_weights`), and the trainer adapts the UNet family's
(SD-1/2, SDXL), SD3's and Flux's denoisers (lora.TARGETS); PixArt has no LoRA (in diffusers 0.42
PixArtSigmaPipeline has no `load_lora_weights`). StartTrainingFunction reads a base's model_index.json when it
claims a job and halts the lineage before any job is paid for when its class is not one of these
(core.start_training.pretrained); the trainer's own check at job start stays for the bases it cannot read cheaply.
tests/unit/test_lora_pipelines.py fails when diffusers and this table disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

DIFFUSERS = "0.42"  # the release the table was checked against (constraints.txt)
LORA_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "FluxPipeline")


def takes_lora(pipeline: str) -> bool:
    """Whether a base whose model_index.json names this `_class_name` can be trained with `train: lora`."""
    return pipeline in LORA_PIPELINES


def trains_lora(hyperparameters: Mapping[str, str]) -> bool:
    """Whether a job with these (SageMaker, string) hyperparameters trains a LoRA (TrainOptions.train)."""
    return hyperparameters.get("train") == "lora"
