"""A lineage's pretrained base (PretrainedModelUri) as the `pretrained` channel, an autoencoder job only
where it brings no VAE, and lineage.json naming the parts, under moto with SageMaker as AWS has it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import boto3
import pytest

from atelier.cli_provenance import model_parts
from contracts.s3_layout import output_key
from core import aws
from core.provenance import stored_lineage
from core.start_training.settings import TrainingSettings
from core.start_training.pretrained import BaseMissing
from core.start_training.starter import resume
from tests.functions.autoencoder_helpers import ENCODE, NO_VAE, ON, PIPELINE, autoencoded, channels, put_base, vae_of
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure: fixtures)
    FakeSageMaker,
    configure,
    finish,
    job,
    lineage,
    manifest_uri,
    pending,
    put_latents,
    sagemaker,
    seal,
    sid,
    stack,
)


# --- a base -------------------------------------------------------------------------------------------

def listing_sha256(settings: TrainingSettings, prefix: str) -> str:
    """sha256 over "<key after the prefix>\\t<size>\\t<ETag>\\n", sorted by key (docs/training-jobs.md)."""
    listing = boto3.client("s3").list_objects_v2(Bucket=settings.models_bucket, Prefix=prefix)["Contents"]
    lines = sorted(f"{o['Key'].removeprefix(prefix)}\t{o['Size']}\t{o['ETag'].strip(chr(34))}\n" for o in listing)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def test_a_base_with_a_vae_needs_no_autoencoder_and_reaches_encode_and_training_as_pretrained(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), PIPELINE)
    settings = configure(**ON, **ENCODE, TRAINING_PRETRAINED_MODEL_URI=uri)

    name = seal(settings, 1, 2)[1].job_name
    put_latents(settings, name, 1, 2)
    finish(settings, f"{name}-enc", "Completed")

    assert sagemaker.created == [f"{name}-enc", name]
    encode, train = sagemaker.request(f"{name}-enc"), sagemaker.request(name)
    assert channels(encode) == {"train": manifest_uri(settings, name), "pretrained": uri}
    assert channels(train) == {"train": f"s3://{settings.data_bucket}/manifests/{name}.latents.manifest",
                               "pretrained": uri}
    assert encode["HyperParameters"]["pretrained"] == train["HyperParameters"]["pretrained"] == "pretrained"
    assert [c["InputMode"] for c in train["InputDataConfig"]] == ["FastFile", "File"]
    assert (lineage(settings)["autoencoder"], job(settings, name)["autoencoder"]) == (False, False)


def test_the_job_records_the_base_and_its_digest_when_claimed(configure: Callable[..., TrainingSettings],
                                                              sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), PIPELINE)
    settings = configure(TRAINING_PRETRAINED_MODEL_URI=uri)

    name = seal(settings, 1, 2)[1].job_name

    assert json.loads(job(settings, name)["pretrained"]) == {
        "uri": uri, "kind": "prefix", "digest": listing_sha256(settings, "bases/sd2/"),
        "size": sum(len(b) for b in PIPELINE.values()), "objects": len(PIPELINE), "has_vae": True,
        "has_tokenizer": True, "pipeline": "StableDiffusionPipeline"}


def test_a_changed_base_halts_the_lineage_before_any_job_until_it_is_set_back(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, stack) -> None:
    from atelier import client, operator_requests
    uri = put_base(configure(), PIPELINE)
    settings = configure(TRAINING_PRETRAINED_MODEL_URI=uri)
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")
    digest = json.loads(job(settings, first)["pretrained"])["digest"]
    assert lineage(settings)["base_digest"] == digest == listing_sha256(settings, "bases/sd2/")

    # WHEN the base changes under the lineage (its checkpoints were trained from the first one)
    put_base(settings, {"text_encoder/config.json": b'{"hidden_size": 8}'})
    decision = seal(settings, 3, 4)[1]

    # THEN nothing is claimed or started; the lineage halts, saying why and what to do
    assert decision.action == "halted" and len(sagemaker.created) == 1
    assert pending(settings) == [sid(3), sid(4)]
    held = next(line for line in client.pipeline_status(stack.outputs).lineages if line["name"] == "main")["held"]
    assert held.startswith("halted: BaseChanged: lineage main was trained from the base with digest " + digest[:16])
    assert "Set TrainingLineage to a new name" in held

    # WHEN the base is set back and the lineage resumed, the manifest is claimed with the first digest
    put_base(settings, {"text_encoder/config.json": PIPELINE["text_encoder/config.json"]})
    operator_requests.resume_lineage(stack.outputs, "main")
    second = resume(settings).job_name  # StartTrainingFunction, given the CLI's event
    assert len(sagemaker.created) == 2 and json.loads(job(settings, second)["pretrained"])["digest"] == digest


def test_a_lineage_without_a_base_may_not_take_one_later(configure: Callable[..., TrainingSettings],
                                                         sagemaker: FakeSageMaker) -> None:
    settings = configure()
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")
    assert lineage(settings)["base_digest"] == "none"

    later = configure(TRAINING_PRETRAINED_MODEL_URI=put_base(settings, PIPELINE))
    assert seal(later, 3, 4)[1].action == "halted" and len(sagemaker.created) == 1
    assert "was trained from no base" in lineage(later)["failures"][-1]["reason"]


def test_a_base_without_a_vae_gets_an_autoencoder_job_that_reads_the_base(configure: Callable[..., TrainingSettings],
                                                                         sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), NO_VAE, "bases/text-only/")
    settings = configure(**ON, TRAINING_PRETRAINED_MODEL_URI=uri)

    name = seal(settings, 1, 2)[1].job_name
    autoencoded(sagemaker, settings, name)

    ae, train = sagemaker.request(f"{name}-ae"), sagemaker.request(name)
    assert channels(ae) == {"train": manifest_uri(settings, name), "pretrained": uri}
    assert ae["HyperParameters"]["pretrained"] == "pretrained"
    assert channels(train) == {"train": manifest_uri(settings, name), "pretrained": uri, "vae": vae_of(settings, name)}
    assert {k: train["HyperParameters"][k] for k in ("pretrained", "vae")} == {"pretrained": "pretrained", "vae": "vae"}


def test_a_model_tar_gz_base_is_taken_to_hold_a_vae(configure: Callable[..., TrainingSettings],
                                                    sagemaker: FakeSageMaker) -> None:
    key = "bases/sd2/model.tar.gz"
    etag = boto3.client("s3").put_object(Bucket=configure().models_bucket, Key=key, Body=b"gzip bytes")["ETag"]
    settings = configure(**ON, TRAINING_PRETRAINED_MODEL_URI=f"s3://{configure().models_bucket}/{key}")

    name = seal(settings, 1, 2)[1].job_name

    assert sagemaker.created == [name]
    assert channels(sagemaker.request(name))["pretrained"] == f"s3://{settings.models_bucket}/{key}"
    assert json.loads(job(settings, name)["pretrained"]) == {
        "uri": f"s3://{settings.models_bucket}/{key}", "kind": "archive", "digest": etag.strip('"'), "size": 10,
        "objects": 1, "has_vae": True, "has_tokenizer": True, "pipeline": None}


def test_a_base_that_is_not_there_claims_nothing(configure: Callable[..., TrainingSettings],
                                                 sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_PRETRAINED_MODEL_URI=f"s3://{configure().models_bucket}/bases/missing/")
    seal(settings, 1)

    with pytest.raises(BaseMissing, match="bases/missing/: no objects under it"):
        seal(settings, 2)

    assert pending(settings) == [sid(1), sid(2)] and sagemaker.created == []


# --- lineage.json ---------------------------------------------------------------------------------------

def test_lineage_json_names_the_base_its_digest_and_the_lineage_s_vae(configure: Callable[..., TrainingSettings],
                                                                      sagemaker: FakeSageMaker) -> None:
    uri = put_base(configure(), NO_VAE, "bases/text-only/")
    settings = configure(**ON, TRAINING_PRETRAINED_MODEL_URI=uri)
    name = seal(settings, 1, 2)[1].job_name
    autoencoded(sagemaker, settings, name)

    finish(settings, name, "Completed")

    stored = json.loads(aws.read_object(settings.models_bucket, output_key(name, "lineage.json")))
    assert stored["schema_version"] == 2
    assert stored["pretrained"] == {"uri": uri, "kind": "prefix", "digest": listing_sha256(settings, "bases/text-only/"),
                                    "size": sum(len(b) for b in NO_VAE.values()), "objects": len(NO_VAE),
                                    "has_vae": False, "has_tokenizer": True,
                                    "pipeline": "StableDiffusionPipeline"}
    assert stored["vae"] == {"source": "autoencoder", "uri": vae_of(settings, name), "autoencoder_job": f"{name}-ae"}
    assert model_parts(stored_lineage(name, settings)) == [
        f"base: {uri} (prefix, {len(NO_VAE)} objects, {sum(len(b) for b in NO_VAE.values())} bytes, "
        f"sha256 {listing_sha256(settings, 'bases/text-only/')})",
        f"VAE: {vae_of(settings, name)} (autoencoder job {name}-ae)"]


def test_lineage_json_of_a_job_without_pretrained_parts_says_so(configure: Callable[..., TrainingSettings],
                                                                 sagemaker: FakeSageMaker) -> None:
    settings = configure()
    name = seal(settings, 1, 2)[1].job_name

    finish(settings, name, "Completed")

    stored = json.loads(aws.read_object(settings.models_bucket, output_key(name, "lineage.json")))
    assert (stored["pretrained"], stored["vae"]) == (None, {"source": "random", "uri": "", "autoencoder_job": ""})
    assert model_parts(stored_lineage(name, settings)) == ["base: none (random parts)", "VAE: random (frozen)"]
