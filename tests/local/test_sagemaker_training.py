"""The local SageMaker's training jobs through boto3: statuses, events, validation, channels, checkpoints, failures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from atelier.local.sagemaker import LocalSageMaker
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    REGION,
    aws,
    error_of,
    job_events,
    model_files,
    moto_url,
    overrides,
    put_shards,
    read_tar,
    s3,
    s3_text,
    service,
    sm,
    training_request,
    wait_for,
    wait_for_job,
)

pytestmark = pytest.mark.slow(seconds=10)
TRAINING_SEQUENCE = [("InProgress", "Starting"), ("InProgress", "Downloading"), ("InProgress", "Training"),
                     ("InProgress", "Uploading"), ("Completed", "Completed")]


# --- training jobs ------------------------------------------------------------------------------

def test_job_runs_to_completed_with_the_model_archive(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar", "shards/sub/b.tar", "elsewhere/c.tar")

    arn = sm.create_training_job(**training_request("atelier-0123456789abcdef0123"))["TrainingJobArn"]

    assert arn == "arn:aws:sagemaker:us-east-1:123456789012:training-job/atelier-0123456789abcdef0123"
    assert sm.describe_training_job(TrainingJobName="atelier-0123456789abcdef0123")["TrainingJobStatus"] == \
        "InProgress"
    job = wait_for_job(sm, "atelier-0123456789abcdef0123", "Completed", "Failed")
    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Completed", "Completed")
    assert job["ModelArtifacts"]["S3ModelArtifacts"] == \
        "s3://models/training/atelier-0123456789abcdef0123/output/model.tar.gz"
    assert [t["Status"] for t in job["SecondaryStatusTransitions"]] == [s for _, s in TRAINING_SEQUENCE]
    assert job["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert job["CreationTime"] <= job["TrainingStartTime"] <= job["TrainingEndTime"]
    archive = read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])
    assert sorted(archive) == ["files.json", "hosts", "hosts/algo-1.json", "sub", "sub/weights.bin"]
    assert json.loads(archive["files.json"]) == {
        "channels": {"train": ["a.tar", "sub/b.tar"]}, "hyperparameters": {"steps": "2"}, "resumed_from": None}


def test_job_writes_the_sagemaker_config_files(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")

    sm.create_training_job(**training_request("config-files", hyperparameters={"seed": "7"}))
    wait_for_job(sm, "config-files", "Completed")

    config = service.settings.state_dir / "jobs" / "config-files" / "algo-1" / "opt_ml" / "input" / "config"
    assert json.loads((config / "hyperparameters.json").read_text()) == {"steps": "2", "seed": "7"}
    assert json.loads((config / "inputdataconfig.json").read_text()) == {"train": {
        "TrainingInputMode": "FastFile", "S3DistributionType": "ShardedByS3Key", "RecordWrapperType": "None"}}
    assert json.loads((config / "resourceconfig.json").read_text()) == {
        "current_host": "algo-1", "current_instance_type": "ml.g5.xlarge", "current_group_name": "homogeneousCluster",
        "hosts": ["algo-1"], "instance_groups": [{"instance_group_name": "homogeneousCluster",
                                                  "instance_type": "ml.g5.xlarge", "hosts": ["algo-1"]}],
        "network_interface_name": "eth0"}
    assert "trained step 1" in (service.settings.state_dir / "jobs/config-files/algo-1/logs.txt").read_text()
    assert json.loads((service.settings.state_dir / "jobs" / "config-files" / "job.json").read_text())[
        "TrainingJobStatus"] == "Completed"


def test_each_status_change_puts_one_event_mirroring_describe(sm: Any, s3: Any, job_events: Callable) -> None:
    put_shards(s3, "shards/a.tar")
    request = training_request("evented", Tags=[{"Key": "lineage", "Value": "base"}])
    request["CheckpointConfig"] = {"S3Uri": "s3://models/checkpoints/base/"}

    sm.create_training_job(**request)

    events = job_events("evented", "Completed")
    assert [(e["detail"]["TrainingJobStatus"], e["detail"]["SecondaryStatus"]) for e in events] == TRAINING_SEQUENCE
    last = events[-1]
    assert (last["source"], last["detail-type"]) == ("aws.sagemaker", "SageMaker Training Job State Change")
    assert last["resources"] == ["arn:aws:sagemaker:us-east-1:123456789012:training-job/evented"]
    detail = last["detail"]
    assert detail["ModelArtifacts"] == {"S3ModelArtifacts": "s3://models/training/evented/output/model.tar.gz"}
    assert detail["HyperParameters"] == {"steps": "2"}
    assert detail["CheckpointConfig"] == {"S3Uri": "s3://models/checkpoints/base/", "LocalPath": "/opt/ml/checkpoints"}
    assert detail["InputDataConfig"] == request["InputDataConfig"]
    assert detail["OutputDataConfig"] == request["OutputDataConfig"]
    assert detail["Tags"] == {"lineage": "base"}
    assert all(isinstance(detail[key], int) for key in ("CreationTime", "TrainingStartTime", "TrainingEndTime"))
    assert "FailureReason" not in detail


def test_duplicate_job_name_is_resource_in_use(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")
    sm.create_training_job(**training_request("twice"))

    code, message = error_of(lambda: sm.create_training_job(**training_request("twice")))

    assert code == "ResourceInUse"
    assert "training-job/twice" in message


@pytest.mark.parametrize("name", ["under_score", "-leading", "x" * 64])
def test_job_name_must_match_the_sagemaker_pattern(sm: Any, name: str) -> None:
    code, message = error_of(lambda: sm.create_training_job(**training_request(name)))

    assert code == "ValidationException"
    assert "regular expression pattern" in message


@pytest.mark.parametrize("member", ["RoleArn", "ResourceConfig", "AlgorithmSpecification"])
def test_required_members_are_checked(sm: Any, member: str) -> None:
    # RoleArn: botocore's model; the others the model leaves optional (AlgorithmName, InstanceGroups: not emulated)
    request = training_request("incomplete")
    del request[member]
    unchecked = boto3.client("sagemaker", region_name=REGION, config=Config(parameter_validation=False))

    code, _ = error_of(lambda: unchecked.create_training_job(**request))

    assert code == "ValidationException"


def test_a_job_without_a_stopping_condition_gets_a_day(sm: Any, s3: Any) -> None:
    # botocore's model leaves StoppingCondition optional; API reference: MaxRuntimeInSeconds defaults to 1 day
    put_shards(s3, "shards/a.tar")
    request = training_request("no-limit")
    del request["StoppingCondition"]

    sm.create_training_job(**request)

    assert sm.describe_training_job(TrainingJobName="no-limit")["StoppingCondition"] == {"MaxRuntimeInSeconds": 86400}
    wait_for_job(sm, "no-limit", "Completed", "Failed")


def test_describe_and_stop_of_unknown_job_are_validation_exceptions(sm: Any) -> None:
    assert error_of(lambda: sm.describe_training_job(TrainingJobName="nope")) == \
        ("ValidationException", "Requested resource not found.")
    assert error_of(lambda: sm.stop_training_job(TrainingJobName="nope"))[0] == "ValidationException"


def test_manifest_channel_holds_exactly_the_listed_keys(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar", "shards/b.tar", "shards/x/c.tar")
    s3.put_object(Bucket="data", Key="manifests/m.manifest",
                  Body=json.dumps([{"prefix": "s3://data/shards/"}, "a.tar", "x/c.tar"]).encode())

    sm.create_training_job(**training_request("manifested", "s3://data/manifests/m.manifest", "ManifestFile"))
    job = wait_for_job(sm, "manifested", "Completed", "Failed")

    assert model_files(s3, job)["channels"] == {"train": ["a.tar", "x/c.tar"]}


def test_model_channels_hold_a_prefix_s_objects_at_their_paths_and_a_single_key_as_its_file(
        sm: Any, s3: Any, service: LocalSageMaker) -> None:
    # GIVEN a base (a prefix, beside a neighbour that shares its name's start) and an autoencoder's archive
    put_shards(s3, "shards/a.tar")
    base = {"model_index.json": b"{}", "vae/config.json": b'{"latent_channels": 4}',
            "text_encoder/model.safetensors": b"weights"}
    for name, body in base.items():
        s3.put_object(Bucket="models", Key=f"bases/sd2/{name}", Body=body)
    s3.put_object(Bucket="models", Key="bases/sd2-old/vae/config.json", Body=b"another base")
    s3.put_object(Bucket="models", Key="autoencoder/j-ae/output/model.tar.gz", Body=b"gzip bytes")
    request = training_request("model-channels")
    request["InputDataConfig"] += [
        {"ChannelName": name, "InputMode": "File", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}
        for name, uri in (("pretrained", "s3://models/bases/sd2/"),
                          ("vae", "s3://models/autoencoder/j-ae/output/model.tar.gz"))]

    # WHEN the job runs
    sm.create_training_job(**request)
    job = wait_for_job(sm, "model-channels", "Completed", "Failed")

    # THEN /opt/ml/input/data/pretrained is the base's tree and .../vae holds the one archive
    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    assert model_files(s3, job)["channels"] == {"train": ["a.tar"], "pretrained": sorted(base),
                                                "vae": ["model.tar.gz"]}
    data = service.settings.state_dir / "jobs" / "model-channels" / "algo-1" / "opt_ml" / "input" / "data"
    assert {name: (data / "pretrained" / name).read_bytes() for name in base} == base
    assert (data / "vae" / "model.tar.gz").read_bytes() == b"gzip bytes"


def test_empty_channel_fails_the_job(sm: Any, s3: Any) -> None:
    sm.create_training_job(**training_request("no-data", "s3://data/nothing-here/"))

    job = wait_for_job(sm, "no-data", "Completed", "Failed")

    assert job["TrainingJobStatus"] == "Failed"
    assert job["FailureReason"].startswith('ClientError: No S3 objects found under S3 URL "s3://data/nothing-here/"')


def test_checkpoints_sync_during_the_job_and_restore_into_the_next(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")
    checkpoint = {"S3Uri": "s3://models/checkpoints/base/"}

    # GIVEN a job that lingers after writing its first checkpoint
    sm.create_training_job(**training_request("first", hyperparameters={"sleep": "1.5"},
                                              CheckpointConfig=checkpoint))
    # THEN the checkpoint reaches S3 while the job is still training
    wait_for(lambda: s3.list_objects_v2(Bucket="models", Prefix="checkpoints/base/latest").get("KeyCount"),
             what="the checkpoint in S3")
    assert sm.describe_training_job(TrainingJobName="first")["TrainingJobStatus"] == "InProgress"
    wait_for_job(sm, "first", "Completed")

    # WHEN a second job uses the same S3Uri
    sm.create_training_job(**training_request("second", CheckpointConfig=checkpoint))
    second = wait_for_job(sm, "second", "Completed", "Failed")

    # THEN it resumed from the first one's checkpoint and its own checkpoint was synced at the end
    assert model_files(s3, second)["resumed_from"] == "1"
    assert s3_text(s3, "models", "checkpoints/base/latest") == "2"
    assert s3_text(s3, "models", "checkpoints/base/step-2.txt") == "weights at step 2"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="models", Prefix="checkpoints/base/")["Contents"]]
    assert sorted(keys) == ["checkpoints/base/latest", "checkpoints/base/step-1.txt", "checkpoints/base/step-2.txt"]


def test_tensorboard_files_reach_the_s3_output_path_of_finished_and_failed_jobs(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")
    for name, hyperparameters in (("board-ok", {}), ("board-failed", {"fail": "boom"})):
        sm.create_training_job(**training_request(name, hyperparameters=hyperparameters, TensorBoardOutputConfig={
            "S3OutputPath": f"s3://models/tensorboard/{name}/"}))
        job = wait_for_job(sm, name, "Completed", "Failed")
        assert job["TensorBoardOutputConfig"] == {"S3OutputPath": f"s3://models/tensorboard/{name}/",
                                                  "LocalPath": "/opt/ml/output/tensorboard"}
        assert s3_text(s3, "models", f"tensorboard/{name}/run/events.out.fake") == "events of algo-1"
    sm.create_training_job(**training_request("no-board"))
    wait_for_job(sm, "no-board", "Completed")
    assert not s3.list_objects_v2(Bucket="models", Prefix="tensorboard/no-board").get("KeyCount")


def test_tensorboard_output_path_must_be_an_s3_uri(sm: Any) -> None:
    refused = r"'tensorBoardOutputConfig\.s3OutputPath' failed to satisfy constraint: Member must satisfy regular expression"
    with pytest.raises(ClientError, match=refused):
        sm.create_training_job(**training_request("bad-board", TensorBoardOutputConfig={"S3OutputPath": "/tmp/x"}))


def test_failing_container_fails_the_job_with_its_failure_file(sm: Any, s3: Any, job_events: Callable) -> None:
    put_shards(s3, "shards/a.tar")
    checkpoint = {"S3Uri": "s3://models/checkpoints/failing/"}

    sm.create_training_job(**training_request("failing", hyperparameters={"fail": "CUDA out of memory"},
                                              CheckpointConfig=checkpoint))
    job = wait_for_job(sm, "failing", "Completed", "Failed")

    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Failed", "Failed")
    assert job["FailureReason"] == "CUDA out of memory"
    assert "ModelArtifacts" not in job
    assert job_events("failing", "Failed")[-1]["detail"]["FailureReason"] == "CUDA out of memory"
    assert s3_text(s3, "models", "checkpoints/failing/latest") == "1"  # synced on failure too


def test_exit_without_failure_file_reports_the_exit_code_and_log(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")

    sm.create_training_job(**training_request("exits", hyperparameters={"exit-code": "3"}))
    job = wait_for_job(sm, "exits", "Completed", "Failed")

    assert job["FailureReason"].startswith("AlgorithmError: exit code 3.")
    assert "trained step 1" in job["FailureReason"]


def test_stop_training_job_ends_stopped(sm: Any, s3: Any, job_events: Callable, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")
    sm.create_training_job(**training_request("stopped", hyperparameters={"sleep": "30"}))
    model_dir = service.settings.state_dir / "jobs/stopped/algo-1/opt_ml/model"
    wait_for((model_dir / "sub/weights.bin").exists, what="the container to save its model")

    sm.stop_training_job(TrainingJobName="stopped")

    assert sm.describe_training_job(TrainingJobName="stopped")["TrainingJobStatus"] in ("Stopping", "Stopped")
    job = wait_for_job(sm, "stopped", "Stopped", "Failed", "Completed")
    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Stopped", "Stopped")
    # what the container saved in model/ before the stop is still uploaded, as SageMaker does
    assert job["ModelArtifacts"]["S3ModelArtifacts"].endswith("/stopped/output/model.tar.gz")
    statuses = [e["detail"]["TrainingJobStatus"] for e in job_events("stopped", "Stopped")]
    assert statuses[-2:] == ["Stopping", "Stopped"]
    code, message = error_of(lambda: sm.stop_training_job(TrainingJobName="stopped"))
    assert (code, message) == ("ValidationException",
                               "The request was rejected because the training job is in status Stopped.")


def test_max_runtime_stops_the_job_as_max_runtime_exceeded(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")

    sm.create_training_job(**training_request("too-long", hyperparameters={"sleep": "30"},
                                              StoppingCondition={"MaxRuntimeInSeconds": 1}))
    job = wait_for_job(sm, "too-long", "Stopped", "Failed", "Completed")

    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")


def test_list_training_jobs_filters_sorts_and_pages(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")
    for name in ("list-a", "list-b", "other-c"):
        sm.create_training_job(**training_request(name))
    for name in ("list-a", "list-b", "other-c"):
        wait_for_job(sm, name, "Completed")

    listed = sm.list_training_jobs(NameContains="list-", SortBy="CreationTime", SortOrder="Descending")
    first_page = sm.list_training_jobs(StatusEquals="Completed", MaxResults=2)
    second_page = sm.list_training_jobs(StatusEquals="Completed", MaxResults=2, NextToken=first_page["NextToken"])

    assert [j["TrainingJobName"] for j in listed["TrainingJobSummaries"]] == ["list-b", "list-a"]
    assert [j["TrainingJobName"] for j in first_page["TrainingJobSummaries"]] == ["list-a", "list-b"]
    assert [j["TrainingJobName"] for j in second_page["TrainingJobSummaries"]] == ["other-c"]
    assert "NextToken" not in second_page
