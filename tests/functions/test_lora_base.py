"""A LoRA recipe (`train: lora`) on a base whose pipeline cannot load LoRA weights halts the lineage when a job
would be claimed, before any encode, autoencoder or training job is paid for; the base's pipeline class is read
from its model_index.json (core.start_training.pretrained), under moto with SageMaker as AWS has it."""

from __future__ import annotations

import json
from typing import Any, Callable

import boto3
import pytest

from core.start_training.pretrained import PretrainedBase, describe_base
from core.start_training.settings import TrainingSettings
from core.start_training.starter import resume
from tests.functions.autoencoder_helpers import ENCODE, NO_VAE, ON, PIPELINE, put_base
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure: fixtures)
    FakeSageMaker,
    configure,
    job,
    lineage,
    pending,
    sagemaker,
    seal,
    sid,
    stack,
)
from tests.support import TEST_RECIPE

PIXART = {**PIPELINE, "model_index.json": b'{"_class_name": "PixArtSigmaPipeline", "_diffusers_version": "0.42.1"}'}
NO_INDEX = {k: v for k, v in PIPELINE.items() if k != "model_index.json"}


def trains(mode: str) -> dict[str, dict[str, Any]]:
    """The test recipe with `train: <mode>`."""
    return {"training": {"hyperparameters": {**TEST_RECIPE["training"]["hyperparameters"], "train": mode}}}


def listed(bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


# --- what describe_base reads of a base ------------------------------------------------------------------

@pytest.mark.parametrize(("files", "pipeline"), [
    (PIPELINE, "StableDiffusionPipeline"),
    (PIXART, "PixArtSigmaPipeline"),
    (NO_INDEX, None),
    ({**PIPELINE, "model_index.json": b'{"_diffusers_version": "0.42.1"}'}, None),  # names no class
    ({**PIPELINE, "model_index.json": b"not json"}, None),  # the trainer, which loads it, says what is wrong
])
def test_a_prefix_base_records_the_pipeline_class_its_model_index_names(
        configure: Callable[..., TrainingSettings], files: dict[str, bytes], pipeline: str | None) -> None:
    base = describe_base(put_base(configure(), files))

    assert (base.kind, base.objects, base.pipeline) == ("prefix", len(files), pipeline)


def test_an_archive_base_records_no_pipeline_class(configure: Callable[..., TrainingSettings]) -> None:
    bucket = configure().models_bucket
    boto3.client("s3").put_object(Bucket=bucket, Key="bases/pixart/model.tar.gz", Body=b"gzip bytes")

    base = describe_base(f"s3://{bucket}/bases/pixart/model.tar.gz")

    assert (base.kind, base.pipeline) == ("archive", None)


def test_a_base_recorded_before_the_pipeline_class_still_reads() -> None:
    old = '{"uri": "s3://b/bases/sd2/", "kind": "prefix", "digest": "ab", "size": 3, "objects": 1, "has_vae": true}'

    assert PretrainedBase.model_validate_json(old).pipeline is None


# --- the claim -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("files", [PIXART, {**NO_VAE, "model_index.json": PIXART["model_index.json"]}],
                         ids=["encode-job-first", "autoencoder-job-first"])
def test_a_lora_recipe_on_a_pixart_base_halts_the_lineage_before_any_job(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, stack, files: dict[str, bytes]) -> None:
    from atelier import client
    # GIVEN a PixArtSigmaPipeline base, and a recipe whose lineage would start with an encode job (a base with a
    # VAE) or an autoencoder job (one without)
    uri = put_base(configure(), files, "bases/pixart/")
    settings = configure(trains("lora"), **ON, **ENCODE, TRAINING_PRETRAINED_MODEL_URI=uri)

    # WHEN the quota's shards are sealed
    decision = seal(settings, 1, 2)[1]

    # THEN nothing is claimed, written or started: the lineage halts, saying why and what to do
    reason = (f"LoraUnsupported: run-plan job 'main' trains a LoRA (train: lora), and PretrainedModelUri {uri} is a "
              "PixArtSigmaPipeline, which cannot load its LoRA weights (diffusers 0.42: StableDiffusionPipeline, "
              "StableDiffusionXLPipeline, StableDiffusion3Pipeline and FluxPipeline can). Train it with train: full "
              "(`atelier recipe set`), or set PretrainedModelUri to a base whose pipeline can; then "
              "`atelier lineage resume`")
    assert (decision.action, sagemaker.requests) == ("halted", [])
    assert pending(settings) == [sid(1), sid(2)] and job(settings, decision.job_name) == {}
    assert listed(settings.data_bucket, "manifests/") == []
    assert lineage(settings)["halted"] is True and lineage(settings)["failures"][-1]["reason"] == reason
    held = next(line for line in client.pipeline_status(stack.outputs).lineages if line["name"] == "main")["held"]
    assert held == f"halted: {reason}"


def test_a_lora_recipe_in_one_run_plan_job_is_named_in_the_halt(configure: Callable[..., TrainingSettings],
                                                                sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), PIXART, "bases/pixart/")
    settings = configure({"training": {"run_plan": [{"name": "base-res", "hyperparameters": {"steps": "3"}},
                                                    {"name": "adapter", "hyperparameters": {"train": "lora"}}]}},
                         TRAINING_PRETRAINED_MODEL_URI=uri)

    assert (seal(settings, 1, 2)[1].action, sagemaker.requests) == ("halted", [])
    assert "run-plan job 'adapter' trains a LoRA" in lineage(settings)["failures"][-1]["reason"]


def test_the_halted_lineage_goes_on_once_the_recipe_trains_full_and_it_is_resumed(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, stack) -> None:
    from atelier import operator_requests
    uri = put_base(configure(), PIXART, "bases/pixart/")
    assert seal(configure(trains("lora"), TRAINING_PRETRAINED_MODEL_URI=uri), 1, 2)[1].action == "halted"

    settings = configure(trains("full"))
    operator_requests.resume_lineage(stack.outputs, "main")
    name = resume(settings).job_name  # StartTrainingFunction, given the CLI's event

    assert sagemaker.created == [name] and pending(settings) == []


def test_a_lora_recipe_on_a_base_that_can_take_it_claims_as_before(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), PIPELINE)
    settings = configure(trains("lora"), TRAINING_PRETRAINED_MODEL_URI=uri)

    decision = seal(settings, 1, 2)[1]

    assert (decision.action, sagemaker.created) == ("started", [decision.job_name])
    assert sagemaker.request(decision.job_name)["HyperParameters"]["train"] == "lora"
    assert json.loads(job(settings, decision.job_name)["pretrained"])["pipeline"] == "StableDiffusionPipeline"
    assert not lineage(settings).get("halted")


def test_a_lora_recipe_on_a_base_of_pipeline_parts_without_their_index_halts(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    """The trainer would refuse it at the job's start (lora.check_run): a LoRA adapts a whole pipeline."""
    uri = put_base(configure(), NO_INDEX)
    settings = configure(trains("lora"), TRAINING_PRETRAINED_MODEL_URI=uri)

    assert (seal(settings, 1, 2)[1].action, sagemaker.requests) == ("halted", [])
    assert (f"PretrainedModelUri {uri} holds no whole diffusers pipeline (model_index.json naming its class)"
            in lineage(settings)["failures"][-1]["reason"])


def test_a_full_recipe_on_a_pixart_base_claims_as_before(configure: Callable[..., TrainingSettings],
                                                         sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), PIXART, "bases/pixart/")
    settings = configure(trains("full"), TRAINING_PRETRAINED_MODEL_URI=uri)

    decision = seal(settings, 1, 2)[1]

    assert (decision.action, sagemaker.created) == ("started", [decision.job_name])
    assert json.loads(job(settings, decision.job_name)["pretrained"])["pipeline"] == "PixArtSigmaPipeline"
