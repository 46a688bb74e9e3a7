"""What the pretrained-part tests share: the autoencoder job switched on, a base put in place, its jobs' ends."""

from __future__ import annotations

from typing import Any, Callable

import boto3
import pytest

from core.start_training.settings import TrainingSettings
from core.start_training.starter import StartDecision
from tests.functions.training_jobs_helpers import FakeSageMaker, finish

ON = {"TRAINING_AUTOENCODER_INSTANCE_TYPE": "ml.g5.2xlarge"}  # the template's default; conftest turns it off
ENCODE = {"TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge"}
AE_HYPERPARAMETERS = {"steps": "20000", "batch-size": "32", "learning-rate": "0.0001"}  # the template's default


@pytest.fixture
def autoencoding(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure(**ON)


def channels(request: dict[str, Any]) -> dict[str, str]:
    """Channel name -> its S3Uri."""
    return {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}


def vae_of(settings: TrainingSettings, name: str) -> str:
    return f"s3://{settings.models_bucket}/autoencoder/{name}-ae/output/model.tar.gz"


def autoencoder_done(sagemaker: FakeSageMaker, settings: TrainingSettings, name: str) -> None:
    """The autoencoder job of training job `name` reaches Completed, with its model.tar.gz."""
    sagemaker.jobs[f"{name}-ae"].update(TrainingJobStatus="Completed",
                                        ModelArtifacts={"S3ModelArtifacts": vae_of(settings, name)})


def autoencoded(sagemaker: FakeSageMaker, settings: TrainingSettings, name: str) -> StartDecision:
    """... and its state-change event arrives."""
    autoencoder_done(sagemaker, settings, name)
    return finish(settings, f"{name}-ae", "Completed")


def put_base(settings: TrainingSettings, files: dict[str, bytes], prefix: str = "bases/sd2/") -> str:
    for name, body in files.items():
        boto3.client("s3").put_object(Bucket=settings.models_bucket, Key=prefix + name, Body=body)
    return f"s3://{settings.models_bucket}/{prefix}"


PIPELINE = {"model_index.json": b'{"_class_name": "StableDiffusionPipeline"}', "vae/config.json": b"{}",
            "vae/diffusion_pytorch_model.safetensors": b"vae weights", "text_encoder/config.json": b"{}",
            "tokenizer/tokenizer_config.json": b"{}", "scheduler/scheduler_config.json": b"{}"}
NO_VAE = {k: v for k, v in PIPELINE.items() if not k.startswith("vae/")}
