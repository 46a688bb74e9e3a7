"""The local SageMaker through plain boto3 clients, with moto (server mode) as S3 and EventBridge.

Containers are tests/local/fake_container.py, mapped from the image FAKE_IMAGE.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from PIL import Image

from atelier.local.sagemaker import LocalSageMaker, Settings, start_local_sagemaker
from atelier.local.sagemaker.training_instances import host_names
from tests.support import moto_server

pytestmark = pytest.mark.slow(seconds=55)
FAKE_CONTAINER = Path(__file__).with_name("fake_container.py")
FAKE_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier-fake:latest"
ROLE = "arn:aws:iam::123456789012:role/atelier-sagemaker"
REGION = "us-east-1"
TRAINING_SEQUENCE = [("InProgress", "Starting"), ("InProgress", "Downloading"), ("InProgress", "Training"),
                     ("InProgress", "Uploading"), ("Completed", "Completed")]


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def aws(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials, every client on moto, moto emptied."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"))
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": moto_url}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def overrides() -> dict[str, Any]:
    """Settings a test changes by parametrizing this name."""
    return {}


@pytest.fixture
def service(aws: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            overrides: dict[str, Any]) -> Iterator[LocalSageMaker]:
    settings = Settings(**{
        "state_dir": tmp_path / "sagemaker", "entrypoints": {FAKE_IMAGE: [sys.executable, str(FAKE_CONTAINER)]},
        "checkpoint_sync_seconds": 0.2, "stop_grace_seconds": 2, "startup_timeout_seconds": 10,
        "invoke_timeout_seconds": 10, **overrides})
    local = start_local_sagemaker(settings)
    for name, value in local.client_environment().items():
        monkeypatch.setenv(name, value)
    yield local
    local.close()


@pytest.fixture
def sm(service: LocalSageMaker) -> Any:
    return boto3.client("sagemaker", region_name=REGION)


@pytest.fixture
def runtime(service: LocalSageMaker) -> Any:
    return boto3.client("sagemaker-runtime", region_name=REGION)


@pytest.fixture
def s3(aws: None) -> Any:
    client = boto3.client("s3", region_name=REGION)
    for bucket in ("data", "models"):
        client.create_bucket(Bucket=bucket)
    return client


@pytest.fixture
def job_events(aws: None) -> Callable[[str, str], list[dict[str, Any]]]:
    """An EventBridge rule on aws.sagemaker delivering to SQS; returns a reader of one job's events."""
    events, sqs = boto3.client("events", region_name=REGION), boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="sagemaker-events")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name="sagemaker-jobs", EventPattern=json.dumps(
        {"source": ["aws.sagemaker"], "detail-type": ["SageMaker Training Job State Change"]}))
    events.put_targets(Rule="sagemaker-jobs", Targets=[{"Id": "queue", "Arn": queue_arn}])
    received: list[dict[str, Any]] = []

    def read(job: str, until_status: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for message in sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", []):
                received.append(json.loads(message["Body"]))
                sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
            mine = [event for event in received if event["detail"]["TrainingJobName"] == job]
            if any(event["detail"]["TrainingJobStatus"] == until_status for event in mine):
                return mine
            time.sleep(0.05)
        raise AssertionError(f"no {until_status} event for {job}; got {received}")

    return read


# --- helpers ------------------------------------------------------------------------------------

def training_request(name: str, channel_uri: str = "s3://data/shards/", data_type: str = "S3Prefix",
                     hyperparameters: dict[str, str] | None = None, **overrides: Any) -> dict[str, Any]:
    request = {
        "TrainingJobName": name,
        "RoleArn": ROLE,
        "AlgorithmSpecification": {"TrainingImage": FAKE_IMAGE, "TrainingInputMode": "FastFile"},
        "HyperParameters": {"steps": "2", **(hyperparameters or {})},
        "InputDataConfig": [{
            "ChannelName": "train", "InputMode": "FastFile",
            "DataSource": {"S3DataSource": {"S3DataType": data_type, "S3Uri": channel_uri,
                                            "S3DataDistributionType": "ShardedByS3Key"}},
        }],
        "OutputDataConfig": {"S3OutputPath": "s3://models/training/"},
        "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": 60},
        "RetryStrategy": {"MaximumRetryAttempts": 2},
    }
    request.update(overrides)
    return request


def put_shards(s3: Any, *keys: str) -> None:
    for key in keys:
        s3.put_object(Bucket="data", Key=key, Body=f"tar bytes of {key}".encode())


def wait_for(condition: Callable[[], Any], timeout: float = 15, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_job(sm: Any, name: str, *statuses: str) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        job = sm.describe_training_job(TrainingJobName=name)
        return job if job["TrainingJobStatus"] in statuses else None
    return wait_for(reached, what=f"{name} to be {statuses}")


def wait_for_endpoint(sm: Any, name: str, *statuses: str) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        endpoint = sm.describe_endpoint(EndpointName=name)
        return endpoint if endpoint["EndpointStatus"] in statuses else None
    return wait_for(reached, what=f"{name} to be {statuses}")


def complete_checkpoint_in_s3(s3: Any, bucket: str, prefix: str) -> int | None:
    """The step of a checkpoint whose manifest and every file it lists (at its size) are in S3, if any."""
    sizes = {o["Key"]: o["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
             for o in page.get("Contents", [])}
    for key in sorted(k for k in sizes if k.endswith("/manifest.json") and k.removeprefix(prefix).startswith("step-")):
        folder = key.rsplit("/", 1)[0]
        manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        if all(sizes.get(f"{folder}/{entry['path']}") == entry["size"] for entry in manifest["files"]):
            return int(manifest["step"])
    return None


def read_tar(s3: Any, uri: str) -> dict[str, bytes | None]:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return {m.name: tar.extractfile(m).read() if m.isfile() else None for m in tar.getmembers()}


def model_files(s3: Any, job: dict[str, Any]) -> dict[str, Any]:
    return json.loads(read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])["files.json"])


def s3_text(s3: Any, bucket: str, key: str) -> str:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def error_of(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(ClientError) as caught:
        call()
    return caught.value.response["Error"]["Code"], caught.value.response["Error"]["Message"]


def put_model(s3: Any, sm: Any, name: str, reply: str, environment: dict[str, str] | None = None,
              isolated: bool = False) -> None:
    """A model whose archive holds reply.txt, plus a one-variant endpoint config of the same name."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        info = tarfile.TarInfo("reply.txt")
        info.size = len(reply.encode())
        tar.addfile(info, io.BytesIO(reply.encode()))
    s3.put_object(Bucket="models", Key=f"training/{name}/output/model.tar.gz", Body=archive.getvalue())
    sm.create_model(ModelName=name, ExecutionRoleArn=ROLE, PrimaryContainer={
        "Image": FAKE_IMAGE, "ModelDataUrl": f"s3://models/training/{name}/output/model.tar.gz",
        "Environment": environment or {}}, EnableNetworkIsolation=isolated)
    sm.create_endpoint_config(EndpointConfigName=name, ProductionVariants=[{
        "VariantName": "AllTraffic", "ModelName": name, "InstanceType": "ml.g5.xlarge", "InitialInstanceCount": 1}])


def invoke(runtime: Any, endpoint: str, prompt: str) -> tuple[dict[str, Any], str]:
    response = runtime.invoke_endpoint(EndpointName=endpoint, ContentType="application/json", Accept="image/png",
                                       Body=json.dumps({"prompt": prompt}))
    return json.loads(response["Body"].read()), response["ContentType"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


# --- several instances, checkpoints and retries --------------------------------------------------

def two_instances(request: dict[str, Any]) -> dict[str, Any]:
    request["ResourceConfig"]["InstanceCount"] = 2
    return request


def host_files(s3: Any, job: dict[str, Any], host: str) -> dict[str, Any]:
    """What the fake container on `host` saw: model/hosts/<host>.json in the job's model archive."""
    return json.loads(read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])[f"hosts/{host}.json"])


def secondary_statuses(job: dict[str, Any]) -> list[str]:
    return [t["Status"] for t in job["SecondaryStatusTransitions"]]


def test_each_instance_gets_its_share_of_a_sharded_channel_and_all_of_a_replicated_one(
        sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/e.tar", "shards/a.tar", "shards/d.tar", "shards/b.tar", "shards/c.tar", "eval/x.tar")
    request = two_instances(training_request("two-hosts"))
    request["InputDataConfig"].append({"ChannelName": "eval", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": "s3://data/eval/", "S3DataDistributionType": "FullyReplicated"}}})

    sm.create_training_job(**request)
    job = wait_for_job(sm, "two-hosts", "Completed", "Failed")

    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    first, second = host_files(s3, job, "algo-1"), host_files(s3, job, "algo-2")
    # ShardedByS3Key: the key-sorted objects dealt round-robin, disjoint shares whose union is the channel
    assert first["channels"]["train"] == ["a.tar", "c.tar", "e.tar"]
    assert second["channels"]["train"] == ["b.tar", "d.tar"]
    # FullyReplicated: every instance has every object
    assert first["channels"]["eval"] == second["channels"]["eval"] == ["x.tar"]
    assert (first["current_host"], second["current_host"]) == ("algo-1", "algo-2")
    assert first["hosts"] == second["hosts"] == ["algo-1", "algo-2"]
    # one model archive gathers every instance's model/
    assert sorted(read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])) == [
        "files.json", "hosts", "hosts/algo-1.json", "hosts/algo-2.json", "sub", "sub/weights.bin"]
    config = service.settings.state_dir / "jobs/two-hosts/algo-2/opt_ml/input/config/resourceconfig.json"
    assert json.loads(config.read_text())["current_host"] == "algo-2"


def test_hosts_are_listed_sorted_as_sagemaker_lists_them() -> None:
    assert host_names(11)[:4] == ["algo-1", "algo-10", "algo-11", "algo-2"]


def test_a_lost_instance_is_retried_from_the_restored_checkpoint(
        sm: Any, s3: Any, service: LocalSageMaker, job_events: Callable) -> None:
    put_shards(s3, "shards/a.tar", "shards/b.tar")
    # GIVEN a two-instance job that lingers after its first checkpoint, unless it resumed from one
    sm.create_training_job(**two_instances(training_request(
        "lossy", hyperparameters={"sleep-unless-resumed": "30"},
        CheckpointConfig={"S3Uri": "s3://models/checkpoints/lossy/"})))
    wait_for(lambda: s3.list_objects_v2(Bucket="models", Prefix="checkpoints/lossy/latest").get("KeyCount"),
             what="the first checkpoint in S3")

    # WHEN one of its instances goes away
    service.lose_training_instance("lossy", "algo-2")
    job = wait_for_job(sm, "lossy", "Completed", "Failed")

    # THEN a second attempt on new instances restored the checkpoint into each and completed
    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    assert host_files(s3, job, "algo-1")["resumed_from"] == host_files(s3, job, "algo-2")["resumed_from"] == "1"
    assert s3_text(s3, "models", "checkpoints/lossy/latest") == "2"
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training",
                                       "Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert job["SecondaryStatusTransitions"][3]["StatusMessage"] == (
        "Restarting the training job after an internal error: attempt 2 of 3 on new instances")
    statuses = [(e["detail"]["TrainingJobStatus"], e["detail"]["SecondaryStatus"])
                for e in job_events("lossy", "Completed")]
    assert statuses == [("InProgress", s) for s in secondary_statuses(job)[:-1]] + [("Completed", "Completed")]
    log = (service.settings.state_dir / "jobs/lossy/algo-2/logs.txt").read_text()
    assert "--- lossy attempt 1 of 3 on algo-2 ---" in log and "--- lossy attempt 2 of 3 on algo-2 ---" in log


def test_a_loss_on_a_condition_is_taken_also_when_the_containers_ended_first(
        sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")
    # GIVEN a job whose container writes its first checkpoint and ends at once
    sm.create_training_job(**training_request(
        "quick", CheckpointConfig={"S3Uri": "s3://models/checkpoints/quick/"}))

    # WHEN its instance is to be lost once that checkpoint's marker is in S3
    service.lose_training_instance("quick", once=lambda: s3.list_objects_v2(
        Bucket="models", Prefix="checkpoints/quick/latest").get("KeyCount"))
    job = wait_for_job(sm, "quick", "Completed", "Failed")

    # THEN the attempt counted as lost, whenever its container ended, and the retry resumed from it
    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training",
                                       "Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert host_files(s3, job, "algo-1")["resumed_from"] == "1"
    assert s3_text(s3, "models", "checkpoints/quick/latest") == "2"


@pytest.mark.parametrize("retry_strategy, losses", [(None, 1), ({"MaximumRetryAttempts": 1}, 2)])
def test_losing_an_instance_on_the_last_attempt_fails_as_an_internal_error(
        sm: Any, s3: Any, service: LocalSageMaker, retry_strategy: dict | None, losses: int) -> None:
    put_shards(s3, "shards/a.tar")
    request = training_request("doomed", hyperparameters={"sleep": "30"})
    request.pop("RetryStrategy")
    if retry_strategy:
        request["RetryStrategy"] = retry_strategy
    sm.create_training_job(**request)

    for attempt in range(1, losses + 1):
        wait_for(lambda: secondary_statuses(sm.describe_training_job(TrainingJobName="doomed")).count("Training")
                 == attempt, what=f"attempt {attempt} to train")
        service.lose_training_instance("doomed")
    job = wait_for_job(sm, "doomed", "Completed", "Failed")

    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Failed", "Failed")
    assert job["FailureReason"] == ("InternalServerError: We encountered an internal error. Please try again. "
                                    f"(local runner: instance algo-1 was lost during attempt {losses} of {losses})")
    assert secondary_statuses(job).count("Training") == losses


def test_a_failing_script_is_not_retried(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar", "shards/b.tar")

    sm.create_training_job(**two_instances(training_request("broken", hyperparameters={"fail": "CUDA out of memory"})))
    job = wait_for_job(sm, "broken", "Completed", "Failed")

    assert (job["TrainingJobStatus"], job["FailureReason"]) == ("Failed", "CUDA out of memory")
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training", "Failed"]


@pytest.mark.parametrize("instance_type", ["ml.p4d.24xlarge", "ml.g5.xlarge", "ml.p5.48xlarge"])
def test_a_volume_key_on_an_instance_store_type_is_refused_as_aws_refuses_it(sm: Any, instance_type: str) -> None:
    resources = {"InstanceType": instance_type, "InstanceCount": 1, "VolumeSizeInGB": 50, "VolumeKmsKeyId": "k"}

    code, message = error_of(lambda: sm.create_training_job(**training_request("keyed", ResourceConfig=resources)))

    assert code == "ValidationException" and instance_type in message


def test_a_volume_key_on_an_ebs_type_is_accepted(sm: Any) -> None:
    resources = {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50, "VolumeKmsKeyId": "k"}

    sm.create_training_job(**training_request("keyed-ebs", ResourceConfig=resources))

    assert sm.describe_training_job(TrainingJobName="keyed-ebs")["ResourceConfig"]["VolumeKmsKeyId"] == "k"


def test_an_endpoint_config_key_on_an_instance_store_type_is_refused(sm: Any, s3: Any) -> None:
    put_model(s3, sm, "kms-model", "ok")
    variant = {"VariantName": "AllTraffic", "ModelName": "kms-model", "InitialInstanceCount": 1}

    code, message = error_of(lambda: sm.create_endpoint_config(
        EndpointConfigName="kms-g5", KmsKeyId="k", ProductionVariants=[{**variant, "InstanceType": "ml.g5.xlarge"}]))
    sm.create_endpoint_config(EndpointConfigName="kms-m5", KmsKeyId="k",
                              ProductionVariants=[{**variant, "InstanceType": "ml.m5.large"}])

    assert code == "ValidationException" and "ml.g5.xlarge" in message


def test_a_variant_startup_timeout_outside_aws_range_is_refused(sm: Any, s3: Any) -> None:
    """API_ProductionVariant: ContainerStartupHealthCheckTimeoutInSeconds lies in 60..3600 (botocore checks
    the minimum before sending; the maximum is the service's to refuse)."""
    put_model(s3, sm, "slow-start", "ok")
    variant = {"VariantName": "AllTraffic", "ModelName": "slow-start", "InitialInstanceCount": 1, "InstanceType": "ml.m5.large"}

    code, message = error_of(lambda: sm.create_endpoint_config(
        EndpointConfigName="too-long", ProductionVariants=[{**variant, "ContainerStartupHealthCheckTimeoutInSeconds": 3601}]))
    sm.create_endpoint_config(EndpointConfigName="in-range",
                              ProductionVariants=[{**variant, "ContainerStartupHealthCheckTimeoutInSeconds": 1200}])

    assert code == "ValidationException" and "containerStartupHealthCheckTimeoutInSeconds" in message and "3600" in message
    assert sm.describe_endpoint_config(EndpointConfigName="in-range")["ProductionVariants"][0][
        "ContainerStartupHealthCheckTimeoutInSeconds"] == 1200


@pytest.mark.parametrize("member, value", [("ResourceConfig", {"InstanceType": "ml.g5.xlarge", "InstanceCount": 0}),
                                           ("RetryStrategy", {"MaximumRetryAttempts": 31})])
def test_instance_count_and_retry_attempts_are_range_checked(sm: Any, member: str, value: dict) -> None:
    code, message = error_of(lambda: sm.create_training_job(**training_request("bad-range", **{member: value})))

    assert code == "ValidationException"
    assert "failed to satisfy constraint: Member must have value" in message



# --- the real trainer ---------------------------------------------------------------------------

TRAINER_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier-trainer:latest"  # unmapped: trainer.container


def tiny_shard(first: int, count: int) -> bytes:
    """A shard in the docs/architecture.md layout: <sha256>.{png,txt,json} per sample, sorted by key."""
    samples = []
    for index in range(first, first + count):
        image = io.BytesIO()
        Image.new("RGB", (48, 48), ((index * 40) % 256, 90, 160)).save(image, format="PNG")
        data = image.getvalue()
        key = hashlib.sha256(data).hexdigest()
        caption = f"a square of colour {index}"
        metadata = {"sha256": key, "partner": "partner-a", "format": "png", "caption": caption,
                    "width": 48, "height": 48, "license": "cc-by-4.0"}
        samples.append((key, [("png", data), ("txt", caption.encode()), ("json", json.dumps(metadata).encode())]))
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key, members in sorted(samples):
            for extension, data in members:
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return shard.getvalue()


def lineage_tokenizer(s3: Any, shards: list[bytes]) -> str:
    """The tokenizer job's folders for these shards, under an S3 prefix (the `tokenizer` channel)."""
    from trainer.jobs import tokenizer as tokenizer_job
    with tempfile.TemporaryDirectory() as work:
        for number, shard in enumerate(shards):
            (Path(work) / "shards").mkdir(exist_ok=True)
            (Path(work) / "shards" / f"s-{number}.tar").write_bytes(shard)
        tokenizer_job.main(tokenizer_job.parse_args(["--train-dir", f"{work}/shards", "--model-dir", f"{work}/model",
                                                     "--model-config", "tiny"]))
        for path in sorted((Path(work) / "model").rglob("*")):
            if path.is_file() and "health" not in path.relative_to(Path(work) / "model").parts:
                s3.put_object(Bucket="data", Key=f"tokenizers/e2e/{path.relative_to(Path(work) / 'model')}",
                              Body=path.read_bytes())
    return "s3://data/tokenizers/e2e/"


def trainer_events(log: Path) -> list[dict[str, Any]]:
    """The trainer's JSON log lines (rank 0 logs, so algo-1's log holds them)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


@pytest.mark.e2e
@pytest.mark.parametrize("overrides", [{"checkpoint_sync_seconds": 0.2, "stop_grace_seconds": 5}])
def test_the_trainer_on_two_instances_resumes_after_losing_one(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    # GIVEN two shards, one per instance, and a 4-step job on two instances checkpointing every step and
    # keeping every checkpoint (none is pruned before the sync uploads it)
    s3.put_object(Bucket="data", Key="shards/s-0.tar", Body=tiny_shard(0, 4))
    s3.put_object(Bucket="data", Key="shards/s-1.tar", Body=tiny_shard(4, 4))
    request = two_instances(training_request(
        "trainer-e2e", CheckpointConfig={"S3Uri": "s3://models/checkpoints/e2e/"},
        StoppingCondition={"MaxRuntimeInSeconds": 600}))
    request["AlgorithmSpecification"]["TrainingImage"] = TRAINER_IMAGE
    # the lineage's tokenizer, as its tokenizer job leaves it: each host sees only its own shards' captions
    request["InputDataConfig"].append({**request["InputDataConfig"][0], "ChannelName": "tokenizer", "DataSource": {
        "S3DataSource": {**request["InputDataConfig"][0]["DataSource"]["S3DataSource"],
                         "S3Uri": lineage_tokenizer(s3, [tiny_shard(0, 4), tiny_shard(4, 4)]),
                         "S3DataDistributionType": "FullyReplicated"}}})
    request["HyperParameters"] = {"steps": "4", "batch-size": "2", "resolution": "32", "checkpoint-every": "1",
                                  "keep-checkpoints": "4", "seed": "0", "model-config": "tiny", "num-workers": "0",
                                  "log-every": "1", "validation-prompts": "", "tokenizer": "tokenizer"}
    sm.create_training_job(**request)

    # WHEN the leader's instance is lost once a whole checkpoint has reached S3 (each instance uploads its
    # own files: `latest` can be there before the step directory it names, which would not verify). The
    # condition is tested after each upload and nothing of the attempt reaches S3 after it holds, so the
    # loss comes before the attempt's end however fast its steps run.
    service.lose_training_instance("trainer-e2e", "algo-1",
                                   once=lambda: complete_checkpoint_in_s3(s3, "models", "checkpoints/e2e/"))
    job = wait_for(lambda: (j := sm.describe_training_job(TrainingJobName="trainer-e2e"))["TrainingJobStatus"]
                   in ("Completed", "Failed", "Stopped") and j, timeout=180, what="the job to end")

    # THEN the second attempt resumed from the checkpoint under torchrun on both hosts and completed
    assert job["TrainingJobStatus"] == "Completed", (job.get("FailureReason"), service.training_log_tail("trainer-e2e"))
    assert secondary_statuses(job).count("Training") == 2
    events = trainer_events(service.settings.state_dir / "jobs/trainer-e2e/algo-1/logs.txt")
    resumed = [e for e in events if e.get("event") == "resumed"]
    assert len(resumed) == 1 and 1 <= resumed[0]["step"] < 4, [e for e in events if e.get("event")]
    starts = [e for e in events if e.get("event") == "start"]
    assert [(e["step"], e["world_size"], e["backend"]) for e in starts] == [
        (0, 2, "gloo"), (resumed[0]["step"], 2, "gloo")]
    archive = read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])
    assert "model_index.json" in archive
    assert json.loads(archive["atelier-training.json"])["steps"] == 4


# --- endpoints ----------------------------------------------------------------------------------

def test_endpoint_goes_in_service_and_serves_the_model(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1", {"FAKE_READY_DELAY": "0.5"})

    arn = sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")["EndpointArn"]

    assert arn == "arn:aws:sagemaker:us-east-1:123456789012:endpoint/atelier"
    assert sm.describe_endpoint(EndpointName="atelier")["EndpointStatus"] == "Creating"
    endpoint = wait_for_endpoint(sm, "atelier", "InService", "Failed")
    assert endpoint["EndpointStatus"] == "InService"
    assert endpoint["EndpointConfigName"] == "model-v1"
    assert endpoint["ProductionVariants"][0]["VariantName"] == "AllTraffic"
    assert endpoint["ProductionVariants"][0]["CurrentInstanceCount"] == 1
    assert invoke(runtime, "atelier", "a red fox") == (
        {"prompt": "a red fox", "model": "v1", "accept": "image/png"}, "application/json")
    assert [e["EndpointName"] for e in sm.list_endpoints()["Endpoints"]] == ["atelier"]


def test_a_network_isolated_container_gets_no_aws_credentials(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    # AWS: with EnableNetworkIsolation "no AWS credentials are made available to the container runtime
    # environment" (docs/aws-differences.md); the model's own Environment is passed all the same
    put_model(s3, sm, "isolated", "v1", {"AWS_MINE": "kept"}, isolated=True)
    put_model(s3, sm, "open", "v1")

    for name in ("isolated", "open"):
        sm.create_endpoint(EndpointName=name, EndpointConfigName=name)
    for name in ("isolated", "open"):
        wait_for_endpoint(sm, name, "InService")

    given = {name: json.loads(next(service.settings.state_dir.glob(f"endpoints/{name}/{name}/opt_ml/serve.aws.json"))
                              .read_text()) for name in ("isolated", "open")}
    assert given["isolated"] == {"AWS_MINE": "kept", "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                                 "AWS_CONFIG_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= set(given["open"])


def test_update_endpoint_switches_to_the_new_config(sm: Any, s3: Any, runtime: Any, service: LocalSageMaker) -> None:
    put_model(s3, sm, "model-v1", "v1")
    put_model(s3, sm, "model-v2", "v2", {"FAKE_READY_DELAY": "0.5"})
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")
    old_pid = int(next(service.settings.state_dir.glob("endpoints/atelier/model-v1/opt_ml/serve.pid")).read_text())

    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="model-v2")

    updating = sm.describe_endpoint(EndpointName="atelier")
    assert (updating["EndpointStatus"], updating["EndpointConfigName"]) == ("Updating", "model-v1")
    assert invoke(runtime, "atelier", "during")[0]["model"] == "v1"  # the old one serves meanwhile
    endpoint = wait_for_endpoint(sm, "atelier", "InService")
    assert endpoint["EndpointConfigName"] == "model-v2"
    assert "FailureReason" not in endpoint
    assert invoke(runtime, "atelier", "after")[0]["model"] == "v2"
    wait_for(lambda: not pid_alive(old_pid), what="the old container to stop")


def test_failed_update_rolls_back_to_the_old_config(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    put_model(s3, sm, "broken", "never", {"FAKE_SERVE": "crash"})
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")

    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="broken")

    endpoint = wait_for(lambda: (e := sm.describe_endpoint(EndpointName="atelier"))["EndpointStatus"] != "Updating"
                        and e, what="the update to end")
    assert (endpoint["EndpointStatus"], endpoint["EndpointConfigName"]) == ("InService", "model-v1")
    assert "exited with code 3" in endpoint["FailureReason"]
    assert "cannot load the model" in endpoint["FailureReason"]
    assert invoke(runtime, "atelier", "still")[0]["model"] == "v1"


@pytest.mark.parametrize("overrides", [{"startup_timeout_seconds": 1.0}])
def test_endpoint_whose_container_never_passes_ping_fails(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "unhealthy", "x", {"FAKE_SERVE": "unhealthy"})

    sm.create_endpoint(EndpointName="sick", EndpointConfigName="unhealthy")
    endpoint = wait_for_endpoint(sm, "sick", "Failed", "InService")

    assert endpoint["EndpointStatus"] == "Failed"
    assert "did not pass the ping health check within 1 seconds" in endpoint["FailureReason"]
    assert error_of(lambda: invoke(runtime, "sick", "x")) == (
        "ValidationError", "Endpoint sick of account 123456789012 not found.")


def test_unknown_endpoint_is_validation_error(sm: Any, runtime: Any) -> None:
    assert error_of(lambda: sm.describe_endpoint(EndpointName="missing")) == (
        "ValidationException", 'Could not find endpoint "arn:aws:sagemaker:us-east-1:123456789012:endpoint/missing".')
    assert error_of(lambda: invoke(runtime, "missing", "x")) == (
        "ValidationError", "Endpoint missing of account 123456789012 not found.")
    assert error_of(lambda: sm.create_endpoint(EndpointName="e", EndpointConfigName="missing"))[0] == \
        "ValidationException"


def test_duplicate_model_config_and_endpoint_are_rejected(sm: Any, s3: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")

    assert error_of(lambda: put_model(s3, sm, "model-v1", "v1"))[1].startswith("Cannot create already existing model")
    assert error_of(lambda: sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1"))[1] == (
        'Cannot create already existing endpoint "arn:aws:sagemaker:us-east-1:123456789012:endpoint/atelier".')


def test_container_error_is_model_error(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")

    with pytest.raises(ClientError) as caught:
        runtime.invoke_endpoint(EndpointName="atelier", ContentType="application/json", Body=b"{}")

    assert caught.value.response["Error"]["Code"] == "ModelError"
    assert caught.value.response["OriginalStatusCode"] == 400
    assert caught.value.response["OriginalMessage"] == "prompt is required"


def test_delete_endpoint_stops_its_container(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")
    pid = int((service.settings.state_dir / "endpoints/atelier/model-v1/opt_ml/serve.pid").read_text())

    sm.delete_endpoint(EndpointName="atelier")

    assert error_of(lambda: sm.describe_endpoint(EndpointName="atelier"))[0] == "ValidationException"
    wait_for(lambda: not pid_alive(pid), what="the container to stop")


# --- shutdown -----------------------------------------------------------------------------------

def test_close_stops_every_container(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    sm.create_training_job(**training_request("long", hyperparameters={"sleep": "60"}))
    state = service.settings.state_dir
    wait_for_endpoint(sm, "atelier", "InService")
    wait_for(lambda: sm.describe_training_job(TrainingJobName="long")["SecondaryStatus"] == "Training",
             what="training")
    # the status says Training just before the container starts: wait until it has written its pid
    train_pid = state / "jobs/long/algo-1/opt_ml/train.pid"
    wait_for(lambda: train_pid.is_file() and train_pid.read_text().strip(), what="the training container")
    pids = [int((state / "endpoints/atelier/model-v1/opt_ml/serve.pid").read_text()), int(train_pid.read_text())]

    service.close()

    assert not any(pid_alive(pid) for pid in pids)
    assert json.loads((state / "jobs/long/job.json").read_text())["TrainingJobStatus"] == "Stopped"
