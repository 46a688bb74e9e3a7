"""core.start_training.job_requests with pretrained parts: the autoencoder job's request, and the `pretrained` and
`vae` channels of encode and training jobs; PretrainedModelUri as the settings parse it.

The orchestration (which job starts when, the lineage's VAE) is in tests/functions/test_autoencoder_jobs.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import boto3
import pytest
from botocore.validate import validate_parameters

from contracts.metrics import AUTOENCODER_METRIC_DEFINITIONS
from core.errors import ConfigError
from core.start_training.run_plan import PlannedJob
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import autoencoder_job_request, encode_job_request, training_job_request
from core.start_training.pretrained import listing_digest
from tests.unit.settings_helpers import TRAINING_ENV
from tests.unit.training_helpers import DIGEST, MANIFEST_URI, SETTINGS, TWO_STAGES

DATA, MODELS = SETTINGS.data_bucket, SETTINGS.models_bucket
JOB = "atelier-0123456789abcdef0123"
BASE = f"s3://{MODELS}/bases/sd2/"
VAE = f"s3://{MODELS}/autoencoder/{JOB}-ae/output/model.tar.gz"
EXCLUSIONS = f"s3://{DATA}/manifests/{JOB}.json"
VALIDATION = f"s3://{DATA}/eval/"
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's TrainingJobName pattern
AE_SETTINGS = dataclasses.replace(
    SETTINGS, encode_instance_type="ml.g5.2xlarge", autoencoder_instance_type="ml.g5.2xlarge",
    autoencoder_hyperparameters={"steps": "20000", "batch-size": "32", "learning-rate": "0.0001"},
    run_plan=(PlannedJob("main", "ml.p5.48xlarge", 2, {"steps": "100", "batch-size": "8", "resolution": "256", "seed": "3",
                                                "model-config": "sd2", "aspect-buckets": "true"}),))


def file_channel(name: str, uri: str) -> dict:
    return {"ChannelName": name, "InputMode": "File", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}


def tags(request: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in request["Tags"]}


# --- the autoencoder job --------------------------------------------------------------------------

AE = autoencoder_job_request(JOB, MANIFEST_URI, DIGEST, 0, AE_SETTINGS, EXCLUSIONS, pretrained_uri=BASE,
                             validation_uri=VALIDATION)


def test_autoencoder_job_is_named_after_its_training_job() -> None:
    assert AE["TrainingJobName"] == f"{JOB}-ae"
    assert JOB_NAME.fullmatch(autoencoder_job_request(f"{JOB}-s9", MANIFEST_URI, DIGEST, 0, AE_SETTINGS)["TrainingJobName"])


def test_autoencoder_job_hyperparameters_are_its_own_with_the_stage_s_model_seed_and_resolution() -> None:
    assert AE["HyperParameters"] == {"task": "autoencoder", "model-config": "sd2", "seed": "3", "resolution": "256",
                                     "steps": "20000", "batch-size": "32", "learning-rate": "0.0001",
                                     "pretrained": "pretrained"}


def test_autoencoder_job_reads_the_image_shards_exclusions_held_out_shards_and_the_base() -> None:
    assert AE["InputDataConfig"] == [
        {"ChannelName": "train", "InputMode": "FastFile", "ContentType": "application/x-tar",
         "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile", "S3Uri": MANIFEST_URI,
                                         "S3DataDistributionType": "ShardedByS3Key"}}},
        {**file_channel("manifest", EXCLUSIONS), "ContentType": "application/json"},
        file_channel("validation", VALIDATION),
        file_channel("pretrained", BASE),
    ]


def test_autoencoder_job_without_a_base_or_held_out_shards_reads_the_shards_alone() -> None:
    request = autoencoder_job_request(JOB, MANIFEST_URI, DIGEST, 0, AE_SETTINGS)

    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train"]
    assert "pretrained" not in request["HyperParameters"]


def test_autoencoder_job_runs_on_one_autoencoder_instance_and_checkpoints_per_lineage() -> None:
    assert (AE["ResourceConfig"]["InstanceType"], AE["ResourceConfig"]["InstanceCount"]) == ("ml.g5.2xlarge", 1)
    assert AE["OutputDataConfig"] == {"S3OutputPath": f"s3://{MODELS}/autoencoder/"}
    assert AE["CheckpointConfig"] == {"S3Uri": f"s3://{MODELS}/checkpoints/main-ae/", "LocalPath": "/opt/ml/checkpoints"}
    assert AE["AlgorithmSpecification"] == {"TrainingImage": "atelier-trainer:latest", "TrainingInputMode": "FastFile",
                                            "MetricDefinitions": AUTOENCODER_METRIC_DEFINITIONS}
    assert (AE["EnableNetworkIsolation"], AE["RetryStrategy"]) == (True, {"MaximumRetryAttempts": 3})


def test_autoencoder_job_is_tagged_like_an_encode_job_with_its_role() -> None:
    assert tags(AE) == {"atelier:manifest": DIGEST, "atelier:lineage": "main", "atelier:stage": "main",
                        "atelier:final-stage": "false", "atelier:role": "autoencoder", "atelier:training-job": JOB}


def test_autoencoder_hyperparameters_win_over_the_stage_s_but_never_change_the_task() -> None:
    settings = dataclasses.replace(AE_SETTINGS, autoencoder_hyperparameters={"resolution": "512", "task": "train"})

    assert autoencoder_job_request(JOB, MANIFEST_URI, DIGEST, 0, settings)["HyperParameters"] == {
        "task": "autoencoder", "model-config": "sd2", "seed": "3", "resolution": "512"}


@pytest.mark.parametrize(("field", "line", "value"), [
    ("loss", {"step": 50, "loss": 0.01234, "l1": 0.012, "kl": 311.5, "psnr_db": 27.31}, "0.01234"),
    ("psnr_db", {"step": 50, "loss": 0.01234, "l1": 0.012, "kl": 311.5, "psnr_db": 27.31}, "27.31"),
    ("loss", {"step": 50, "loss": 1.5e-05, "psnr_db": 31.0}, "1.5e-05"),
])
def test_autoencoder_metrics_parse_the_autoencoder_s_log_lines(field: str, line: dict, value: str) -> None:
    regex = next(d["Regex"] for d in AUTOENCODER_METRIC_DEFINITIONS if d["Name"] == f"autoencoder:{field}")

    assert re.search(regex, json.dumps(line)).group(1) == value


# --- encode and training jobs with pretrained parts -------------------------------------------------

def test_training_job_reads_the_base_and_the_lineage_s_vae_as_channels() -> None:
    request = training_job_request(JOB, MANIFEST_URI, DIGEST, 0, 100, SETTINGS, EXCLUSIONS, pretrained_uri=BASE,
                                   vae_uri=VAE)

    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train", "manifest", "pretrained", "vae"]
    assert request["InputDataConfig"][2:] == [file_channel("pretrained", BASE), file_channel("vae", VAE)]
    assert request["HyperParameters"] == {"steps": "100", "batch-size": "32", "resolution": "256", "seed": "0",
                                          "pretrained": "pretrained", "vae": "vae"}


def test_encode_job_reads_the_same_base_and_vae_as_its_training_job() -> None:
    encode = encode_job_request(JOB, MANIFEST_URI, DIGEST, 0, AE_SETTINGS, pretrained_uri=BASE, vae_uri=VAE)
    train = training_job_request(JOB, MANIFEST_URI, DIGEST, 0, 100, AE_SETTINGS, pretrained_uri=BASE, vae_uri=VAE)

    assert encode["InputDataConfig"][1:] == train["InputDataConfig"][1:] == [file_channel("pretrained", BASE),
                                                                             file_channel("vae", VAE)]
    assert encode["HyperParameters"] == {"task": "encode", "resolution": "256", "seed": "3", "model-config": "sd2",
                                         "aspect-buckets": "true", "pretrained": "pretrained", "vae": "vae"}
    assert {k: train["HyperParameters"][k] for k in ("pretrained", "vae")} == {"pretrained": "pretrained", "vae": "vae"}


def test_without_pretrained_parts_a_job_has_no_model_channels() -> None:
    request = training_job_request(JOB, MANIFEST_URI, DIGEST, 0, 100, SETTINGS, pretrained_uri="")

    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train"]
    assert "pretrained" not in request["HyperParameters"] and "vae" not in request["HyperParameters"]


def test_a_request_built_by_hand_takes_the_base_from_the_settings() -> None:
    # trainer.launch: the deployed function's settings, no job record
    request = training_job_request(JOB, MANIFEST_URI, DIGEST, 0, 100, dataclasses.replace(SETTINGS, pretrained_uri=BASE))

    assert request["InputDataConfig"][1:] == [file_channel("pretrained", BASE)]


def test_every_request_with_pretrained_parts_is_a_valid_create_training_job_request() -> None:
    shape = boto3.client("sagemaker", region_name="us-east-1").meta.service_model.operation_model(
        "CreateTrainingJob").input_shape
    settings = dataclasses.replace(AE_SETTINGS, kms_key="arn:aws:kms:us-east-1:123456789012:key/k", keep_alive_s=600)

    validate_parameters(AE, shape)
    validate_parameters(autoencoder_job_request(JOB, MANIFEST_URI, DIGEST, 0, settings, pretrained_uri=BASE), shape)
    validate_parameters(encode_job_request(JOB, MANIFEST_URI, DIGEST, 0, settings, EXCLUSIONS, pretrained_uri=BASE,
                                           vae_uri=VAE), shape)
    validate_parameters(training_job_request(f"{JOB}-s1", MANIFEST_URI, DIGEST, 1, 100, TWO_STAGES, EXCLUSIONS,
                                             pretrained_uri=BASE, vae_uri=VAE), shape)


# --- PretrainedModelUri in the settings -------------------------------------------------------------

@pytest.mark.parametrize("uri", [
    "s3://my-models/bases/sd2/", "s3://my-models/sd2/", "s3://my.models-1/a/b/c-d_e.f/",
    "s3://my-models/bases/sd2/model.tar.gz", "s3://my-models/model.tar.gz",
])
def test_a_prefix_or_a_model_tar_gz_is_a_base(uri: str) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_PRETRAINED_MODEL_URI": uri}).pretrained_uri == uri


def test_no_base_is_the_default() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV).pretrained_uri == ""
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_PRETRAINED_MODEL_URI": " "}).pretrained_uri == ""


@pytest.mark.parametrize("uri", [
    "s3://my-models/bases/sd2",  # a prefix without its "/": it would match bases/sd2-old/ too
    "s3://my-models/bases/sd2/weights.tar.gz",  # the trainer unpacks model.tar.gz only
    "s3://my-models/bases/sd2/unet/diffusion_pytorch_model.safetensors",
    "s3://my-models/", "s3://my-models",  # a whole bucket
    "https://my-models.s3.amazonaws.com/bases/sd2/", "my-models/bases/sd2/", "/opt/ml/input/data/pretrained/",
    "s3://My_Models/bases/sd2/",  # not a bucket name
    "s3://my-models/bases/*/", "s3://my-models/bases/sd 2/",  # a wildcard, a space (IAM resources are built from it)
    "s3://my-models/bases//sd2/", "s3://my-models/bases/../sd2/",
])
def test_anything_else_is_a_config_error_that_says_what_a_base_is(uri: str) -> None:
    with pytest.raises(ConfigError, match=r"PretrainedModelUri.* must be an s3:// prefix ending in '/'.* or the s3:// key of "
                                          r"a model\.tar\.gz"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_PRETRAINED_MODEL_URI": uri})


def test_autoencoder_settings_are_parsed_once() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_AUTOENCODER_INSTANCE_TYPE": "ml.g5.2xlarge",
                                          "TRAINING_AUTOENCODER_HYPERPARAMETERS": '{"steps": 400, "batch-size": "16"}',
                                          "TRAINING_EVAL_DATA_URI": "s3://atelier-data/eval/"})

    assert (settings.autoencoder_instance_type, settings.autoencoder_hyperparameters, settings.eval_data_uri) == (
        "ml.g5.2xlarge", {"steps": "400", "batch-size": "16"}, "s3://atelier-data/eval/")


def test_autoencoder_hyperparameters_must_be_a_flat_json_object() -> None:
    with pytest.raises(ConfigError, match="TRAINING_AUTOENCODER_HYPERPARAMETERS must be a JSON object"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_AUTOENCODER_HYPERPARAMETERS": '["steps"]'})


def test_a_lineage_named_like_another_s_autoencoder_checkpoints_is_refused() -> None:
    with pytest.raises(ConfigError, match="TRAINING_LINEAGE='main-ae' must not end in '-ae'"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_LINEAGE": "main-ae"})


def test_a_prefix_digest_covers_every_key_size_and_etag_in_key_order() -> None:
    listing = [("vae/config.json", 500, "e1"), ("model_index.json", 300, "e2")]

    digest = listing_digest(listing)

    assert digest == listing_digest(list(reversed(listing)))
    assert len({digest, listing_digest([("vae/config.json", 501, "e1"), listing[1]]),
                listing_digest([("vae/config.json", 500, "e3"), listing[1]]),
                listing_digest([("vae/config.jsn", 500, "e1"), listing[1]])}) == 4
