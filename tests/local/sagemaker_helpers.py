"""What the local SageMaker tests share: plain boto3 clients on the local SageMaker, moto (server mode)
as S3 and EventBridge, and helpers to make and wait for its jobs and endpoints.

Containers are tests/local/fake_container.py, mapped from the image FAKE_IMAGE.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from PIL import Image

from atelier.local.sagemaker import LocalSageMaker, Settings, start_local_sagemaker
from tests.support import moto_server

FAKE_CONTAINER = Path(__file__).with_name("fake_container.py")
FAKE_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier-fake:latest"
ROLE = "arn:aws:iam::123456789012:role/atelier-sagemaker"
REGION = "us-east-1"


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


def wait_for(condition: Callable[[], Any], timeout: float = 120, what: str = "condition") -> Any:
    """Poll until condition() holds. The timeout only catches a hang: a container's Python starts in a
    second here but in tens of seconds on a loaded two-core CI machine, which the design allows."""
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
