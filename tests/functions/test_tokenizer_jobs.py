"""The lineage's own tokenizers, under moto with resources from template.yaml and SageMaker as AWS has it
(training_jobs_helpers.FakeSageMaker): the tokenizer job `<job>-tok` before a lineage's first job when the
base brings no tokenizer, after the autoencoder job when both run, and its model.tar.gz as the
`tokenizer` channel of every later encode and training job of the lineage.
"""

from __future__ import annotations

import json
from typing import Callable

import pytest

from atelier.cli_provenance import model_parts
from contracts.s3_layout import output_key
from core import aws

from core.deploy.events import JobState
from core.provenance import stored_lineage
from core.start_training.settings import TrainingSettings
from core.start_training.starter import StartDecision
from tests.functions.autoencoder_helpers import ENCODE, NO_VAE, ON, PIPELINE, autoencoded, channels, put_base, vae_of
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure: fixtures)
    FakeSageMaker,
    configure,
    finish,
    job,
    lineage,
    manifest_uri,
    sagemaker,
    seal,
    stack,
    tags,
)

TOKENIZE = {"TRAINING_TOKENIZER_INSTANCE_TYPE": "ml.m5.xlarge"}  # the template sets it from AutoencoderInstanceType


@pytest.fixture
def tokenizing(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure(**TOKENIZE)


def tokenizer_of(settings: TrainingSettings, name: str) -> str:
    return f"s3://{settings.models_bucket}/tokenizers/{name}-tok/output/model.tar.gz"


def tokenized(sagemaker: FakeSageMaker, settings: TrainingSettings, name: str) -> StartDecision:
    """The tokenizer job of training job `name` reaches Completed, with its model.tar.gz, and its event arrives."""
    sagemaker.jobs[f"{name}-tok"].update(TrainingJobStatus="Completed",
                                         ModelArtifacts={"S3ModelArtifacts": tokenizer_of(settings, name)})
    return finish(settings, f"{name}-tok", "Completed")


def test_without_a_base_the_first_claim_starts_only_the_tokenizer_job(tokenizing: TrainingSettings,
                                                                      sagemaker: FakeSageMaker) -> None:
    name = seal(tokenizing, 1, 2)[1].job_name

    request = sagemaker.request(f"{name}-tok")
    assert sagemaker.created == [f"{name}-tok"]  # nothing reads captions as ids before the lineage has its tokenizer
    assert request["HyperParameters"] == {"task": "tokenizer", "model-config": "tiny"}
    assert channels(request) == {"train": manifest_uri(tokenizing, name)}
    assert (request["ResourceConfig"]["InstanceType"], request["ResourceConfig"]["InstanceCount"]) == ("ml.m5.xlarge", 1)
    assert request["OutputDataConfig"]["S3OutputPath"] == f"s3://{tokenizing.models_bucket}/tokenizers/"
    assert tags(request)["atelier:role"] == "tokenizer" and tags(request)["atelier:training-job"] == name
    assert (job(tokenizing, name)["tokenizer"], lineage(tokenizing)["tokenizer"]) == (True, True)


def test_a_completed_tokenizer_job_gives_the_lineage_its_tokenizer_and_the_training_job_reads_it(
        tokenizing: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(tokenizing, 1, 2)[1].job_name

    decision = tokenized(sagemaker, tokenizing, name)

    uri = tokenizer_of(tokenizing, name)
    assert decision == StartDecision("tokenized", name)
    assert sagemaker.created == [f"{name}-tok", name]
    assert channels(sagemaker.request(name))["tokenizer"] == uri
    assert sagemaker.request(name)["HyperParameters"]["tokenizer"] == "tokenizer"
    assert (lineage(tokenizing)["tokenizer_uri"], lineage(tokenizing)["tokenizer_job"]) == (uri, f"{name}-tok")


def test_with_an_autoencoder_and_encoding_the_order_is_vae_tokenizer_encode_each_reading_what_came_before(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    settings = configure(**ON, **TOKENIZE, **ENCODE)
    name = seal(settings, 1, 2)[1].job_name

    autoencoded(sagemaker, settings, name)
    assert sagemaker.created == [f"{name}-ae", f"{name}-tok"]
    tokenized(sagemaker, settings, name)

    encode = sagemaker.request(f"{name}-enc")
    assert sagemaker.created == [f"{name}-ae", f"{name}-tok", f"{name}-enc"]
    assert channels(encode) == {"train": manifest_uri(settings, name), "vae": vae_of(settings, name),
                                "tokenizer": tokenizer_of(settings, name)}
    assert encode["HyperParameters"]["tokenizer"] == "tokenizer"


def test_the_lineage_s_next_manifest_reads_the_same_tokenizer_and_learns_no_second_one(
        tokenizing: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a first manifest waiting for the lineage's tokenizer, and a second queued behind it meanwhile
    first, _, second = (d.job_name for d in seal(tokenizing, 1, 2, 3, 4)[1:])
    assert job(tokenizing, second)["tokenizer"] is True
    tokenized(sagemaker, tokenizing, first)

    # WHEN the first job completes
    assert finish(tokenizing, first, "Completed") == StartDecision("started", second)

    # THEN the second starts at once with the first's tokenizer: one tokenizer job for the lineage
    assert sagemaker.created == [f"{first}-tok", first, second]
    assert channels(sagemaker.request(second))["tokenizer"] == tokenizer_of(tokenizing, first)
    assert job(tokenizing, second)["tokenizer_job"] == f"{first}-tok"


def test_a_failed_tokenizer_job_fails_its_training_job(tokenizing: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(tokenizing, 1, 2)[1].job_name
    sagemaker.jobs[f"{name}-tok"].update(TrainingJobStatus="Failed", FailureReason="no captions")

    decision = finish(tokenizing, f"{name}-tok", "Failed", "no captions")

    assert decision == StartDecision("tokenizer-failed", name)
    assert job(tokenizing, name)["status"] == "Failed"
    assert job(tokenizing, name)["failure_reason"] == f"tokenizer job {name}-tok Failed: no captions"
    assert "tokenizer_uri" not in lineage(tokenizing)


def test_a_lineage_s_tokenizer_is_never_replaced(tokenizing: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(tokenizing, 1, 2)[1].job_name
    tokenized(sagemaker, tokenizing, name)
    sagemaker.jobs[f"{name}-tok"].update(ModelArtifacts={"S3ModelArtifacts": "s3://elsewhere/model.tar.gz"})

    finish(tokenizing, f"{name}-tok", "Completed")  # a redelivered event

    assert lineage(tokenizing)["tokenizer_uri"] == tokenizer_of(tokenizing, name)


@pytest.mark.parametrize("files, tokenizer_job", [(PIPELINE, False), (NO_VAE, False),
                                                  ({"vae/config.json": b"{}"}, True)])
def test_a_base_with_a_tokenizer_folder_needs_no_tokenizer_job(configure: Callable[..., TrainingSettings],
                                                               sagemaker: FakeSageMaker, files: dict,
                                                               tokenizer_job: bool) -> None:
    settings = configure(**TOKENIZE)
    settings = configure(**TOKENIZE, TRAINING_PRETRAINED_MODEL_URI=put_base(settings, files))

    name = seal(settings, 1, 2)[1].job_name

    assert (f"{name}-tok" in sagemaker.created) is tokenizer_job
    assert lineage(settings)["tokenizer"] is tokenizer_job


def test_lineage_json_names_the_lineage_s_tokenizer(tokenizing: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(tokenizing, 1, 2)[1].job_name
    tokenized(sagemaker, tokenizing, name)

    finish(tokenizing, name, "Completed")

    stored = json.loads(aws.read_object(tokenizing.models_bucket, output_key(name, "lineage.json")))
    assert stored["tokenizer"] == {"source": "tokenizer-job", "uri": tokenizer_of(tokenizing, name),
                                   "tokenizer_job": f"{name}-tok"}
    assert [item["name"] for item in stored["manifests"][0]["jobs"]] == [name]  # the helper job is no training job
    assert model_parts(stored_lineage(name, tokenizing))[-1] == (
        f"tokenizer: {tokenizer_of(tokenizing, name)} (tokenizer job {name}-tok)")


def test_the_deploy_stage_knows_a_tokenizer_job_for_a_helper_and_serves_nothing_of_it() -> None:
    state = JobState(name="j-tok", status="Completed", model_data_url="s3://m/tokenizers/j-tok/output/model.tar.gz",
                     failure_reason=None, tags=(("atelier:role", "tokenizer"), ("atelier:final-stage", "false")))

    assert (state.unidentified, state.final_planned_job, state.is_evaluation) == ("", False, False)
