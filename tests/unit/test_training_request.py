"""core.start_training's job request (channels, checkpoints, resources, keys, stages) and its metric definitions."""

from __future__ import annotations

import dataclasses
import json
import re

import boto3
import pytest
from botocore.validate import validate_parameters

from contracts.metrics import METRIC_DEFINITIONS
from core.start_training.run_plan import PlannedJob
from core.start_training.job_requests import planned_job_hyperparameters, training_job_request
from core.start_training.manifests import job_name_for
from tests.unit.training_helpers import BASE_HPS, DIGEST, MANIFEST_URI, MODELS, SETTINGS, TWO_STAGES, manifest_of, ref


# --- training_job_request -------------------------------------------------------------------------

REQUEST = training_job_request("atelier-0123456789abcdef0123", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)


def test_request_names_the_job() -> None:
    assert REQUEST["TrainingJobName"] == "atelier-0123456789abcdef0123"


def test_request_streams_its_one_channel_with_fast_file_sharded_by_key() -> None:
    assert REQUEST["AlgorithmSpecification"] == {"TrainingImage": "atelier-trainer:latest",
                                                 "TrainingInputMode": "FastFile",
                                                 "MetricDefinitions": METRIC_DEFINITIONS}
    assert REQUEST["InputDataConfig"] == [{
        "ChannelName": "train", "InputMode": "FastFile", "ContentType": "application/x-tar",
        "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile", "S3Uri": MANIFEST_URI,
                                        "S3DataDistributionType": "ShardedByS3Key"}},
    }]


def test_request_checkpoints_per_lineage() -> None:
    # not per job: a retried job and the lineage's next job resume from the same prefix
    assert REQUEST["CheckpointConfig"] == {"S3Uri": f"s3://{MODELS}/checkpoints/main/",
                                           "LocalPath": "/opt/ml/checkpoints"}
    other = training_job_request("atelier-ffffffffffffffffffff", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)
    assert other["CheckpointConfig"] == REQUEST["CheckpointConfig"]


def test_request_checkpoint_prefix_follows_the_lineage() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100,
                                   dataclasses.replace(SETTINGS, lineage="faces"))

    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{MODELS}/checkpoints/faces/"


def test_request_sends_tensorboard_files_to_the_job_s_own_prefix() -> None:
    from contracts.container_paths import TENSORBOARD_LOCAL_PATH as LOCAL_PATH
    assert REQUEST["TensorBoardOutputConfig"] == {"S3OutputPath": f"s3://{MODELS}/tensorboard/atelier-0123456789abcdef0123/",
                                                  "LocalPath": LOCAL_PATH}
    assert LOCAL_PATH == "/opt/ml/output/tensorboard"  # SageMaker's default LocalPath, where the trainer writes


def test_request_writes_models_under_training() -> None:
    assert REQUEST["OutputDataConfig"] == {"S3OutputPath": f"s3://{MODELS}/training/"}


def test_request_takes_resources_and_limits_from_settings() -> None:
    assert (REQUEST["RoleArn"], REQUEST["ResourceConfig"], REQUEST["StoppingCondition"], REQUEST["RetryStrategy"]) == (
        "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
        {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200},
        {"MaxRuntimeInSeconds": 432000},
        {"MaximumRetryAttempts": 3},
    )


def test_request_isolates_the_network_and_encrypts_between_containers() -> None:
    assert (REQUEST["EnableNetworkIsolation"], REQUEST["EnableInterContainerTrafficEncryption"]) == (True, True)


def test_request_tags_the_manifest_digest_lineage_and_stage() -> None:
    assert REQUEST["Tags"] == [{"Key": "atelier:manifest", "Value": DIGEST},
                               {"Key": "atelier:lineage", "Value": "main"},
                               {"Key": "atelier:stage", "Value": "main"},
                               {"Key": "atelier:final-stage", "Value": "true"}]


def test_request_without_warm_pool_vpc_or_key_leaves_them_out() -> None:
    assert "KeepAlivePeriodInSeconds" not in REQUEST["ResourceConfig"]
    assert "VolumeKmsKeyId" not in REQUEST["ResourceConfig"]
    assert "KmsKeyId" not in REQUEST["OutputDataConfig"]
    assert "VpcConfig" not in REQUEST


def test_request_keeps_a_warm_pool_when_asked() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100,
                                   dataclasses.replace(SETTINGS, keep_alive_s=600))

    assert request["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200,
                                         "KeepAlivePeriodInSeconds": 600}


def test_request_runs_in_the_vpc_when_subnets_are_given() -> None:
    settings = dataclasses.replace(SETTINGS, subnets=("subnet-a", "subnet-b"), security_groups=("sg-1",))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert request["VpcConfig"] == {"Subnets": ["subnet-a", "subnet-b"], "SecurityGroupIds": ["sg-1"]}


KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@pytest.mark.parametrize("instance_type", ["ml.m5.xlarge", "ml.p3.16xlarge", "ml.c5.9xlarge", "ml.inf2.xlarge"])
def test_request_encrypts_an_ebs_volume_and_the_outputs_with_the_key(instance_type: str) -> None:
    settings = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(PlannedJob("main", instance_type, 1, BASE_HPS),))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert request["OutputDataConfig"] == {"S3OutputPath": f"s3://{MODELS}/training/", "KmsKeyId": KEY}
    assert request["ResourceConfig"]["VolumeKmsKeyId"] == KEY


# AWS: "You can't request a VolumeKmsKeyId when using an instance type with local storage" (the API
# reference's ResourceConfig; docs/aws-differences.md). The outputs are still encrypted with the key.
@pytest.mark.parametrize("instance_type", ["ml.p5.48xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.g5.2xlarge",
                                           "ml.g4dn.xlarge", "ml.g6e.12xlarge", "ml.p3dn.24xlarge", "ml.trn1.32xlarge",
                                           "ml.m5d.large"])
def test_request_sends_no_volume_key_for_an_instance_store_type(instance_type: str) -> None:
    settings = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(PlannedJob("main", instance_type, 1, BASE_HPS),))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert "VolumeKmsKeyId" not in request["ResourceConfig"]
    assert request["OutputDataConfig"]["KmsKeyId"] == KEY


def test_each_stage_of_a_run_plan_gets_the_volume_key_its_instance_type_allows() -> None:
    plan = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(
        PlannedJob("256", "ml.p5.48xlarge", 4, BASE_HPS), PlannedJob("512", "ml.p3.16xlarge", 2, BASE_HPS)))

    first, second = (training_job_request("atelier-x", MANIFEST_URI, DIGEST, stage, 100, plan) for stage in (0, 1))

    assert ("VolumeKmsKeyId" in first["ResourceConfig"], second["ResourceConfig"]["VolumeKmsKeyId"]) == (False, KEY)


def test_request_hyperparameters_are_the_stage_s_with_steps_as_the_lineage_target() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 350, SETTINGS)

    assert request["HyperParameters"] == {"steps": "350", "batch-size": "32", "resolution": "256", "seed": "0"}


def test_request_hyperparameters_are_a_copy() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)
    request["HyperParameters"]["batch-size"] = "1"

    assert SETTINGS.run_plan[0].hyperparameters["batch-size"] == "32"


def test_stage_hyperparameters_are_strings_with_steps_replaced() -> None:
    assert planned_job_hyperparameters(TWO_STAGES.run_plan[1], 80000) == {
        "steps": "80000", "batch-size": "32", "resolution": "512", "seed": "0"}


def test_request_for_an_earlier_stage_uses_its_instances_and_is_not_final() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 50000, TWO_STAGES)

    assert request["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 4, "VolumeSizeInGB": 200}
    assert request["HyperParameters"]["resolution"] == "256"
    assert request["Tags"][2:] == [{"Key": "atelier:stage", "Value": "256"},
                                   {"Key": "atelier:final-stage", "Value": "false"}]


def test_request_for_the_last_stage_uses_its_instances_and_is_final() -> None:
    request = training_job_request("atelier-x-s1", MANIFEST_URI, DIGEST, 1, 80000, TWO_STAGES)

    assert request["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 8, "VolumeSizeInGB": 200}
    assert request["HyperParameters"] == {"steps": "80000", "batch-size": "32", "resolution": "512", "seed": "0"}
    assert request["Tags"][2:] == [{"Key": "atelier:stage", "Value": "512"},
                                   {"Key": "atelier:final-stage", "Value": "true"}]


def test_every_option_on_is_a_valid_create_training_job_request() -> None:
    # botocore's own model of CreateTrainingJob (moto does not validate inputs: AWS-NOTES)
    settings = dataclasses.replace(TWO_STAGES, keep_alive_s=600, subnets=("subnet-a",), security_groups=("sg-1",),
                                   kms_key="arn:aws:kms:us-east-1:123456789012:key/k")
    shape = boto3.client("sagemaker", region_name="us-east-1").meta.service_model.operation_model(
        "CreateTrainingJob").input_shape

    for stage in (0, 1):
        validate_parameters(training_job_request(job_name_for(manifest_of(ref(1)), stage), MANIFEST_URI, DIGEST,
                                                 stage, 80000, settings), shape)


# --- metric definitions against the trainer's log lines -------------------------------------------

def trainer_line(**figures: object) -> str:
    """A training log line as trainer/jobs/train.py prints it (health.log: json.dumps of the fields)."""
    fields = {"step": 10, "stage": 0, "lr": 0.0001, "loss": 0.123, "grad_norm": 1.5, "img_per_s": 12.5,
              "data_wait_share": 0.01, "skipped_steps": 0, "corrupt_samples": 0}
    return json.dumps({**fields, **figures})


def metric(name: str, line: str) -> str | None:
    regex = next(d["Regex"] for d in METRIC_DEFINITIONS if d["Name"] == name)
    found = re.search(regex, line)
    return found.group(1) if found else None


def test_metric_names_are_the_trainer_s_figures() -> None:
    assert [d["Name"] for d in METRIC_DEFINITIONS] == [
        "train:loss", "train:lr", "train:grad_norm", "train:img_per_s", "train:data_wait_share",
        "train:skipped_steps", "train:corrupt_samples"]


@pytest.mark.parametrize(("name", "value"), [
    ("train:loss", "0.123"), ("train:lr", "0.0001"), ("train:img_per_s", "12.5"),
    ("train:data_wait_share", "0.01"), ("train:grad_norm", "1.5"),
])
def test_each_metric_regex_captures_its_value_from_a_trainer_line(name: str, value: str) -> None:
    line = '{"step": 10, "loss": 0.123, "lr": 0.0001, "img_per_s": 12.5, "data_wait_share": 0.01, "grad_norm": 1.5}'

    assert metric(name, line) == value
    assert metric(name, trainer_line()) == value


@pytest.mark.parametrize(("name", "figures", "value"), [
    ("train:lr", {"lr": 1e-05}, "1e-05"),  # json.dumps writes small floats in exponent notation
    ("train:lr", {"lr": 3.3333333333333335e-07}, "3.3333333333333335e-07"),
    ("train:loss", {"loss": 1.2e-05}, "1.2e-05"),
    ("train:loss", {"loss": -0.5}, "-0.5"),
    ("train:grad_norm", {"grad_norm": 3e-06}, "3e-06"),
    ("train:img_per_s", {"img_per_s": 812}, "812"),
    ("train:data_wait_share", {"data_wait_share": 0.0}, "0.0"),
])
def test_metric_regexes_capture_whole_numbers_as_json_writes_them(name: str, figures: dict, value: str) -> None:
    assert metric(name, trainer_line(**figures)) == value


def test_loss_of_a_window_of_skipped_steps_is_no_metric() -> None:
    # health.Window.figures writes "loss": null when every step of the window was skipped
    assert metric("train:loss", trainer_line(loss=None)) is None


@pytest.mark.parametrize("line", [
    json.dumps({"event": "saved", "model_dir": "/opt/ml/model", "steps": 100, "final_loss": 0.2}),
    json.dumps({"event": "start", "step": 0, "steps": 100, "world_size": 8, "device": "cuda:0"}),
    json.dumps({"event": "checkpoint", "step": 10, "dir": "/opt/ml/checkpoints/step-10"}),
])
def test_other_trainer_lines_give_no_metric(line: str) -> None:
    assert [metric(d["Name"], line) for d in METRIC_DEFINITIONS] == [None] * len(METRIC_DEFINITIONS)
