"""What the start-training tests share: the stack from template.yaml under moto, with SageMaker as AWS has it.

moto's SageMaker lets a second CreateTrainingJob of a name overwrite the first and completes jobs at
once (shared/AWS-NOTES.md), so `FakeSageMaker` stands in for its client: a name is refused with
ResourceInUse the second time, requests are checked against botocore's model of the API, and a job
stays InProgress until the test sends its state-change event (`on_job_finished`).
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Callable, Iterator

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.validate import validate_parameters

from atelier.local import recipe as local_recipe
from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import Manifest, ShardRef, ShardSealed
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.starter import StartDecision, on_job_finished, on_shard_sealed
from tests.support import ACCOUNT, REGION, TEST_RECIPE

TWO_STAGES = {"training": {"run_plan": [  # recipe changes
    {"name": "lo", "hyperparameters": {"resolution": "32", "steps": "3"}},
    # one instance: the test stack has no tokenizer job and no base, so a job of several would be refused (each
    # host would learn its own tokenizer); a stage of several instances: tests/unit/test_training_request.py
    {"name": "hi", "instance_type": "ml.m5.2xlarge", "instance_count": 1,
     "hyperparameters": {"resolution": "64", "steps": "5"}},
]}}


# --- SageMaker as AWS behaves -------------------------------------------------------------------

@functools.cache
def create_training_job_shape() -> Any:
    """botocore's model of CreateTrainingJob's input (moto does not validate inputs: AWS-NOTES)."""
    return boto3.client("sagemaker", region_name=REGION).meta.service_model.operation_model(
        "CreateTrainingJob").input_shape


class FakeSageMaker:
    """The two SageMaker operations the stage uses, as AWS answers them."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []  # every CreateTrainingJob, refused ones too
        self.quota_left: int | None = None  # jobs the account's instance quota allows (None: no limit)
        self._lock = threading.Lock()

    def create_training_job(self, **request: Any) -> dict[str, Any]:
        validate_parameters(request, create_training_job_shape())  # raises ParamValidationError, as botocore would
        name = request["TrainingJobName"]
        with self._lock:
            self.requests.append(copy.deepcopy(request))
            if self.quota_left is not None and name not in self.jobs:
                if self.quota_left <= 0:
                    raise ClientError({"Error": {"Code": "ResourceLimitExceeded", "Message": (
                        f"The account-level service limit 'ml.m5.xlarge for training job usage' is 0 Instances, "
                        "with current utilization of 0 Instances and a request delta of 1 Instances.")}},
                        "CreateTrainingJob")
                self.quota_left -= 1
            if name in self.jobs:
                raise ClientError({"Error": {"Code": "ResourceInUse", "Message": (
                    "Training job names must be unique within an AWS account and region, and a training job "
                    f"with this name already exists ({self.arn(name)})")}}, "CreateTrainingJob")
            self.jobs[name] = {**copy.deepcopy(request), "TrainingJobArn": self.arn(name),
                               "TrainingJobStatus": "InProgress"}
        return {"TrainingJobArn": self.arn(name)}

    def describe_training_job(self, TrainingJobName: str) -> dict[str, Any]:  # noqa: N803 (boto3's spelling)
        with self._lock:
            if TrainingJobName not in self.jobs:
                raise ClientError({"Error": {"Code": "ValidationException",
                                             "Message": "Requested resource not found."}}, "DescribeTrainingJob")
            return copy.deepcopy(self.jobs[TrainingJobName])

    @staticmethod
    def arn(name: str) -> str:
        return f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/{name}"

    @property
    def created(self) -> list[str]:
        """Names of the jobs that exist, in the order they were created."""
        return list(self.jobs)

    def request(self, name: str) -> dict[str, Any]:
        return self.jobs[name]


class Serialized:
    """A boto3 client whose calls run one at a time. DynamoDB applies each call atomically; moto does
    not (a failed transaction restores a copy of the whole table), so threads take turns per call."""

    def __init__(self, client: Any, lock: threading.RLock) -> None:
        self._client, self._lock = client, lock

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if name == "get_paginator":
            return lambda operation: _SerializedPaginator(attribute(operation), self._lock)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)
        return call


class _SerializedPaginator:
    def __init__(self, paginator: Any, lock: threading.RLock) -> None:
        self._paginator, self._lock = paginator, lock

    def paginate(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        pages = iter(self._paginator.paginate(**kwargs))
        while True:
            with self._lock:
                page = next(pages, None)
            if page is None:
                return
            yield page


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    """conftest's `module_stack`: provisioned once here; `sagemaker` empties the table and the data
    bucket before each test."""
    return module_stack


def empty(stack: Provisioned) -> None:
    """The pipeline table and the data and models buckets as the template leaves them: empty."""
    dynamodb, s3 = boto3.client("dynamodb"), boto3.client("s3")
    table = stack.outputs["PipelineTableName"]
    for page in dynamodb.get_paginator("scan").paginate(TableName=table, ProjectionExpression="pk"):
        for item in page["Items"]:
            dynamodb.delete_item(TableName=table, Key=item)
    for bucket in (stack.outputs["DataBucketName"], stack.outputs["ModelsBucketName"]):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])
    local_recipe.set_local(stack.outputs, TEST_RECIPE)  # the stack's recipe, as the `stack` fixture set it


@pytest.fixture
def sagemaker(stack: Provisioned, monkeypatch: pytest.MonkeyPatch) -> FakeSageMaker:
    empty(stack)
    fake, lock, real = FakeSageMaker(), threading.RLock(), aws.clients.client
    clients = {service: Serialized(real(service), lock) for service in ("dynamodb", "s3", "events")}  # before any thread
    # the client every module of core.aws (and aws.client) looks up when called
    monkeypatch.setattr(aws.clients, "client", lambda service: fake if service == "sagemaker" else clients[service])
    return fake


@pytest.fixture
def configure(stack: Provisioned, function_env: Callable[[str], dict[str, str]], sagemaker: FakeSageMaker,
              monkeypatch: pytest.MonkeyPatch) -> Callable[..., TrainingSettings]:
    """StartTrainingFunction's environment from the template (quota 2) and the stack's recipe, either changed;
    no replay unless a test asks for it (its own tests below), so manifests are the new shards."""
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0")

    def apply(recipe: dict[str, dict[str, Any]] | None = None, **variables: str) -> TrainingSettings:
        """With the environment's `variables` changed, and the recipe's fields in `recipe` (TEST_RECIPE's otherwise)."""
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        if recipe is not None:
            local_recipe.set_local(stack.outputs, local_recipe.combined(TEST_RECIPE, recipe))
        return TrainingSettings.current()
    return apply


@pytest.fixture
def settings(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure()


# --- helpers ------------------------------------------------------------------------------------

def sealed(settings: TrainingSettings, n: int) -> ShardSealed:
    """Shard n of the stack's data bucket, sealed n minutes past noon."""
    shard_id = f"shard-{n:032x}"
    return ShardSealed(shard_id=shard_id, bucket=settings.data_bucket, key=f"shards/{shard_id}.tar",
                       sha256=f"{n:064x}", size=10240 * n, samples=n, partners=["partner-a"],
                       sealed_at=f"2026-11-29T12:{n:02d}:00+00:00")


def ref(settings: TrainingSettings, n: int, role: str = "new") -> ShardRef:
    s = sealed(settings, n)
    return ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples, partners=("partner-a",),
                    role=role)


def expected_manifest(settings: TrainingSettings, new: list[int], replay: tuple[int, ...] = (),
                      sequence: int = 1) -> Manifest:
    return Manifest(bucket=settings.data_bucket, prefix="shards/", lineage="main", sequence=sequence,
                    shards=tuple([ref(settings, n) for n in new] + [ref(settings, n, "replay") for n in replay]))


def seal(settings: TrainingSettings, *numbers: int) -> list[StartDecision]:
    return [on_shard_sealed(sealed(settings, n), settings) for n in numbers]


def sid(n: int) -> str:
    return f"shard-{n:032x}"


def shard_item(settings: TrainingSettings, n: int) -> dict[str, Any]:
    return aws.get_item(settings.table, pipeline_table.shard_pk(sid(n))) or {}


def index(settings: TrainingSettings, partition: str) -> list[str]:
    return [i["pk"].removeprefix("SHARD#") for i in aws.query_index(settings.table, pipeline_table.PENDING_INDEX, partition)]


def pending(settings: TrainingSettings) -> list[str]:
    return index(settings, pipeline_table.PENDING_SHARDS)


def trained(settings: TrainingSettings) -> list[str]:
    return sorted(index(settings, "SHARDS#trained"))


def lineage(settings: TrainingSettings) -> dict[str, Any]:
    return aws.get_item(settings.table, "LINEAGE#main") or {}


def job(settings: TrainingSettings, name: str) -> dict[str, Any]:
    return aws.get_item(settings.table, pipeline_table.job_pk(name)) or {}


def stored_manifest(settings: TrainingSettings, name: str) -> Manifest:
    return Manifest.model_validate_json(aws.read_object(settings.data_bucket, f"manifests/{name}.json"))


def manifest_uri(settings: TrainingSettings, name: str) -> str:
    return f"s3://{settings.data_bucket}/manifests/{name}.manifest"


def channel_uri(request: dict[str, Any]) -> str:
    return request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"]


def tags(request: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in request["Tags"]}


def finish(settings: TrainingSettings, name: str, status: str, reason: str | None = None) -> StartDecision:
    return on_job_finished(name, status, reason, settings)


# --- the handler --------------------------------------------------------------------------------

def handle(event: dict[str, Any], context: Any) -> dict[str, Any]:
    from start_training.app import lambda_handler
    return lambda_handler(event, context)


# --- latent shards: an encode job before each stage ---------------------------------------------------

ENCODING = "0123456789abcdef-r32"  # <encoder identity>-r<resolution>, as trainer/data/latents.py names it


def put_latents(settings: TrainingSettings, job_name: str, *numbers: int, encoding: str = ENCODING) -> None:
    """What the encode job's CheckpointConfig uploads: a latent twin per shard (and a shard of a
    retried attempt still under its temporary name)."""
    s3 = boto3.client("s3")
    prefix = f"encoded/{job_name}/latents/{encoding}"
    for n in numbers:
        s3.put_object(Bucket=settings.models_bucket, Key=f"{prefix}/{sid(n)}.tar", Body=b"latent shard")
    s3.put_object(Bucket=settings.models_bucket, Key=f"{prefix}/.tmp-{sid(99)}.tar", Body=b"half written")
