"""The start-training stage under moto, resources from template.yaml, with SageMaker as AWS has it.

moto's SageMaker lets a second CreateTrainingJob of a name overwrite the first and completes jobs at
once (shared/AWS-NOTES.md), so `FakeSageMaker` stands in for its client: a name is refused with
ResourceInUse the second time, requests are checked against botocore's model of the API, and a job
stays InProgress until the test sends its state-change event (`on_job_finished`).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.validate import validate_parameters

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import Manifest, ShardRef, ShardSealed
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training import manifests, starter
from core.start_training.manifests import job_name_for, manifest_file
from core.start_training.starter import StartDecision, JobNameCollision, advance, on_job_finished, on_shard_sealed, resume
from tests.support import ACCOUNT, REGION, load_event

pytestmark = pytest.mark.slow(seconds=20)
TWO_STAGES = json.dumps([
    {"name": "lo", "hyperparameters": {"resolution": "32", "steps": "3"}},
    {"name": "hi", "instance_type": "ml.m5.2xlarge", "instance_count": 2,
     "hyperparameters": {"resolution": "64", "steps": "5"}},
])


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
    """StartTrainingFunction's environment from the template (quota 2), with variables changed;
    no replay unless a test asks for it (its own tests below), so manifests are the new shards."""
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0")

    def apply(**variables: str) -> TrainingSettings:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return TrainingSettings.from_env()
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


# --- the quota ----------------------------------------------------------------------------------

def test_first_shard_waits_in_the_pending_index(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    assert settings.quota == 2  # TEST_OVERRIDES

    assert seal(settings, 1) == [StartDecision("waiting", None, 1)]
    assert pending(settings) == [sid(1)]
    assert shard_item(settings, 1)["status"] == "pending"
    assert sagemaker.requests == []


def test_quota_of_shards_starts_exactly_one_job_on_exactly_those_shards(settings: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    decisions = seal(settings, 1, 2)

    name = job_name_for(expected_manifest(settings, [1, 2]))
    assert decisions == [StartDecision("waiting", None, 1), StartDecision("started", name, 2)]
    assert [r["TrainingJobName"] for r in sagemaker.requests] == [name]
    assert channel_uri(sagemaker.request(name)) == manifest_uri(settings, name)


def test_started_job_s_manifests_are_in_the_data_bucket(settings: TrainingSettings) -> None:
    name = seal(settings, 1, 2)[1].job_name

    s3 = boto3.client("s3")
    body = json.loads(s3.get_object(Bucket=settings.data_bucket, Key=f"manifests/{name}.manifest")["Body"].read())
    assert body == [{"prefix": f"s3://{settings.data_bucket}/shards/"}, f"{sid(1)}.tar", f"{sid(2)}.tar"]
    assert stored_manifest(settings, name) == expected_manifest(settings, [1, 2])
    assert body == manifest_file(stored_manifest(settings, name))


def test_started_job_s_shards_open_with_wids_from_its_shard_list(settings: TrainingSettings, tmp_path) -> None:
    """manifests/<job>.wids.json is webdataset's wids shard list: wids itself opens it in a copy of the bucket."""
    import hashlib
    import io

    import wids
    from PIL import Image

    from contracts.messages import Sample
    from core.pack.shards import build_shard

    s3 = boto3.client("s3")
    keys = {}
    for n in (1, 2):  # shard n holds n real samples, as its Shard Sealed event says
        samples = []
        for i in range(n):
            png = io.BytesIO()
            Image.new("RGB", (8, 8), (40 * n, 40 * i, 0)).save(png, format="PNG")
            image = png.getvalue()
            digest = hashlib.sha256(image).hexdigest()
            samples.append((Sample(sha256=digest, partner="partner-a", bucket="uploads", key=f"a/{n}-{i}.png",
                                   format="png", width=8, height=8, size=len(image), caption=f"caption {n}.{i}",
                                   license="CC-BY-4.0", uploaded_at="2026-11-29T12:00:00+00:00", aspect_bucket="1:1",
                                   content_bucket="uploads", content_key=f"a/{n}-{i}.png", content_sha256=digest),
                            image))
            keys[digest] = f"caption {n}.{i}"
        s3.put_object(Bucket=settings.data_bucket, Key=f"shards/{sid(n)}.tar", Body=build_shard(samples))
    name = seal(settings, 1, 2)[1].job_name

    listing = json.loads(s3.get_object(Bucket=settings.data_bucket, Key=f"manifests/{name}.wids.json")["Body"].read())
    assert listing["shardlist"] == [{"url": f"../shards/{sid(1)}.tar", "nsamples": 1},
                                    {"url": f"../shards/{sid(2)}.tar", "nsamples": 2}]
    for key in [f"manifests/{name}.wids.json", f"shards/{sid(1)}.tar", f"shards/{sid(2)}.tar"]:  # `aws s3 sync`
        (tmp_path / "bucket" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "bucket" / key).write_bytes(s3.get_object(Bucket=settings.data_bucket, Key=key)["Body"].read())
    dataset = wids.ShardListDataset(str(tmp_path / "bucket" / "manifests" / f"{name}.wids.json"),
                                    cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 3
    read = {dataset[i]["__key__"]: dataset[i][".txt"] for i in range(len(dataset))}
    assert read == keys
    assert dataset[0][".png"].size == (8, 8)  # decoded by wids' own PIL decoder


def test_wids_shard_list_carries_what_the_trainer_skips(settings: TrainingSettings) -> None:
    manifest = expected_manifest(settings, [1, 2]).model_copy(update={"exclude": {sid(2): ("a" * 64,)}})
    listing = manifests.wids_shard_list(manifest, "job")
    assert listing["name"] == "job" and listing["wids_version"] == 1
    assert listing["shardlist"][0] == {"url": f"../shards/{sid(1)}.tar", "nsamples": 1}
    assert listing["shardlist"][1] == {"url": f"../shards/{sid(2)}.tar", "nsamples": 2, "atelier_exclude": ["a" * 64]}


def test_claim_records_the_job_the_shards_and_the_lineage_lock(settings: TrainingSettings) -> None:
    name = seal(settings, 1, 2)[1].job_name

    record = job(settings, name)
    assert {k: record[k] for k in ("status", "manifest", "shards", "replay", "stage", "base", "steps_base",
                                   "lineage", "digest")} == {
        "status": "Requested", "manifest": f"manifests/{name}.json", "shards": [sid(1), sid(2)], "replay": [],
        "stage": 0, "base": name, "steps_base": 0, "lineage": "main",
        "digest": expected_manifest(settings, [1, 2]).digest}
    assert [(shard_item(settings, n)["status"], shard_item(settings, n)["manifest_job"]) for n in (1, 2)] \
        == [("claimed", name)] * 2
    assert pending(settings) == []
    assert {k: lineage(settings)[k] for k in ("running_job", "sequence", "queue", "steps_done")} == {
        "running_job": name, "sequence": 1, "queue": [], "steps_done": 0}


def test_started_job_request_follows_the_template_settings(settings: TrainingSettings,
                                                           sagemaker: FakeSageMaker) -> None:
    name = seal(settings, 1, 2)[1].job_name

    request = sagemaker.request(name)
    assert request["HyperParameters"] == {"steps": "2", "batch-size": "2", "resolution": "32", "model-config": "tiny"}
    assert request["ResourceConfig"] == {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 200,
                                         "KeepAlivePeriodInSeconds": 600}
    assert request["CheckpointConfig"] == {"S3Uri": f"s3://{settings.models_bucket}/checkpoints/main/",
                                           "LocalPath": "/opt/ml/checkpoints"}
    assert tags(request) == {"atelier:manifest": expected_manifest(settings, [1, 2]).digest,
                             "atelier:lineage": "main", "atelier:stage": "main", "atelier:final-stage": "true"}
    assert "VpcConfig" not in request and "KmsKeyId" not in request["OutputDataConfig"]


def test_redelivered_events_start_no_second_job(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN two shards that started a job
    name = seal(settings, 1, 2)[1].job_name

    # WHEN both events arrive again
    again = seal(settings, 1, 2)

    # THEN they name the claimed job; the re-issued CreateTrainingJob was the same request, refused
    assert again == [StartDecision("already-claimed", name), StartDecision("already-claimed", name)]
    assert sagemaker.created == [name]
    assert sagemaker.requests == [sagemaker.requests[0]] * 3
    assert lineage(settings)["sequence"] == 1


def test_redelivered_event_below_the_quota_counts_its_shard_once(settings: TrainingSettings,
                                                                 sagemaker: FakeSageMaker) -> None:
    assert seal(settings, 1, 1) == [StartDecision("waiting", None, 1), StartDecision("waiting", None, 1)]
    assert pending(settings) == [sid(1)]
    assert sagemaker.requests == []


def test_redelivered_event_restarts_a_claimed_job_that_never_reached_sagemaker(
        settings: TrainingSettings, sagemaker: FakeSageMaker, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a claim whose CreateTrainingJob call failed (the invocation died after the transaction)
    real_create = aws.create_training_job

    def down(request: dict[str, Any]) -> bool:
        raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "CreateTrainingJob")

    monkeypatch.setattr(aws, "create_training_job", down)
    on_shard_sealed(sealed(settings, 1), settings)
    with pytest.raises(ClientError):
        on_shard_sealed(sealed(settings, 2), settings)
    monkeypatch.setattr(aws, "create_training_job", real_create)

    # WHEN the event is delivered again
    again = on_shard_sealed(sealed(settings, 2), settings)

    # THEN the recorded job is created, on the claimed shards
    name = job_name_for(expected_manifest(settings, [1, 2]))
    assert again == StartDecision("already-claimed", name)
    assert sagemaker.created == [name]


# --- while a job runs: queue or skip --------------------------------------------------------------

def test_under_queue_the_next_quota_is_queued_behind_the_running_job(settings: TrainingSettings,
                                                                      sagemaker: FakeSageMaker) -> None:
    assert settings.concurrency == "queue"  # the template's default

    decisions = seal(settings, 1, 2, 3, 4)

    first, second = job_name_for(expected_manifest(settings, [1, 2])), \
        job_name_for(expected_manifest(settings, [3, 4], sequence=2))
    assert decisions == [StartDecision("waiting", None, 1), StartDecision("started", first, 2), StartDecision("waiting", None, 1),
                         StartDecision("queued", second, 2)]
    assert sagemaker.created == [first]
    assert (job(settings, second)["status"], job(settings, second)["shards"]) == ("Queued", [sid(3), sid(4)])
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (first, [second])
    assert [shard_item(settings, n)["manifest_job"] for n in (1, 2, 3, 4)] == [first, first, second, second]
    assert stored_manifest(settings, second) == expected_manifest(settings, [3, 4], sequence=2)


def test_under_skip_shards_stay_pending_while_a_job_runs(configure: Callable[..., TrainingSettings],
                                                         sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_CONCURRENCY="skip")

    decisions = seal(settings, 1, 2, 3, 4)

    first = job_name_for(expected_manifest(settings, [1, 2]))
    assert decisions == [StartDecision("waiting", None, 1), StartDecision("started", first, 2), StartDecision("busy", first),
                         StartDecision("busy", first)]
    assert sagemaker.created == [first]
    assert pending(settings) == [sid(3), sid(4)]
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (first, [])


def claims(settings: TrainingSettings) -> dict[str, list[str]]:
    """Every recorded job's new shards, by job name."""
    return {i["pk"].removeprefix("JOB#"): i["shards"] for i in aws.scan_prefix(settings.table, "JOB#")}


def test_concurrent_shard_events_start_one_job_and_claim_no_shard_twice(settings: TrainingSettings,
                                                                        sagemaker: FakeSageMaker) -> None:
    # WHEN four shards' events are handled at once (quota 2)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: on_shard_sealed(sealed(settings, n), settings), [1, 2, 3, 4]))

    # THEN one job runs, and each shard is in exactly one manifest or still pending
    assert len(sagemaker.created) == 1
    claimed = [s for shards in claims(settings).values() for s in shards]
    assert len(claimed) == len(set(claimed))
    assert sorted(claimed + pending(settings)) == [sid(n) for n in (1, 2, 3, 4)]
    assert len(claims(settings)[sagemaker.created[0]]) == 2


def race(settings: TrainingSettings, monkeypatch: pytest.MonkeyPatch) -> list[StartDecision]:
    """Four invocations that record their shards (1..4), then all read the same state and race to
    claim: one legal interleaving of concurrent invocations, made certain with barriers."""
    recorded, racing = threading.Barrier(4, timeout=10), threading.Barrier(4, timeout=10)
    real_put, real_transact = aws.put_item_if_absent, aws.transact_updates
    raced = threading.local()  # only each invocation's first claim races; a retry goes alone

    def put(table: str, item: dict[str, Any]) -> bool:
        done = real_put(table, item)
        if item.get("kind") == "shard":
            recorded.wait()
        return done

    def transact(*args: Any, **kwargs: Any) -> bool:
        if not getattr(raced, "done", False):
            raced.done = True
            racing.wait()
        return real_transact(*args, **kwargs)

    monkeypatch.setattr(aws, "put_item_if_absent", put)
    monkeypatch.setattr(aws, "transact_updates", transact)
    with ThreadPoolExecutor(4) as pool:
        decisions = list(pool.map(lambda n: on_shard_sealed(sealed(settings, n), settings), [1, 2, 3, 4]))
    monkeypatch.setattr(aws, "put_item_if_absent", real_put)
    monkeypatch.setattr(aws, "transact_updates", real_transact)
    return decisions


def test_invocations_racing_for_one_claim_start_one_job(settings: TrainingSettings, sagemaker: FakeSageMaker,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    decisions = race(settings, monkeypatch)

    # THEN one wins; the losers read again: one queues shards 3 and 4, the others find nothing due
    first = job_name_for(expected_manifest(settings, [1, 2]))
    assert sorted(d.action for d in decisions) == ["queued", "started", "waiting", "waiting"]
    assert sagemaker.created == [first]
    assert claims(settings)[first] == [sid(1), sid(2)]
    claimed = [s for shards in claims(settings).values() for s in shards]
    assert len(claimed) == len(set(claimed))
    assert sorted(claimed + pending(settings)) == [sid(n) for n in (1, 2, 3, 4)]
    assert lineage(settings)["sequence"] == len(claims(settings))


def test_invocation_that_read_the_lineage_before_another_s_claim_starts_nothing(
        settings: TrainingSettings, sagemaker: FakeSageMaker, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an invocation that read the lineage while it was free, before another claimed shards 1
    # and 2 and started a job, and that then reads shards 3 and 4 pending
    seal(settings, 1)
    before = lineage(settings)
    first = seal(settings, 2, 3)[0].job_name
    real_get = aws.get_item
    monkeypatch.setattr(aws, "get_item", lambda table, pk: copy.deepcopy(before) if pk == "LINEAGE#main"
                        else real_get(table, pk))

    # WHEN it handles shard 4
    decision = on_shard_sealed(sealed(settings, 4), settings)

    # THEN its claim fails on the lock: no second job runs beside the first
    monkeypatch.setattr(aws, "get_item", real_get)
    assert decision.action == "already-claimed"
    assert sagemaker.created == [first]
    assert lineage(settings)["running_job"] == first
    assert list(claims(settings)) == [first]


def test_invocations_racing_for_one_claim_still_queue_the_second_quota(
        settings: TrainingSettings, sagemaker: FakeSageMaker, monkeypatch: pytest.MonkeyPatch) -> None:
    race(settings, monkeypatch)

    # THEN under "queue" the two shards the winner did not take are queued as the next manifest,
    # not left pending with no event to come (no shard in two manifests or in none)
    first = job_name_for(expected_manifest(settings, [1, 2]))
    second = job_name_for(expected_manifest(settings, [3, 4], sequence=2))
    assert sagemaker.created == [first]
    assert claims(settings) == {first: [sid(1), sid(2)], second: [sid(3), sid(4)]}
    assert pending(settings) == []
    assert lineage(settings)["queue"] == [second]


# --- a job's end ----------------------------------------------------------------------------------

def test_completed_job_s_shards_become_trained(settings: TrainingSettings) -> None:
    name = seal(settings, 1, 2)[1].job_name

    decision = finish(settings, name, "Completed")

    assert decision == StartDecision("waiting", None, 0)
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["trained", "trained"]
    assert trained(settings) == [sid(1), sid(2)]
    assert ShardRef.model_validate_json(shard_item(settings, 1)["ref"]) == ref(settings, 1)
    assert {k: lineage(settings)[k] for k in ("running_job", "steps_done", "queue")} == {
        "running_job": "", "steps_done": 2, "queue": []}
    assert (job(settings, name)["status"], job(settings, name)["settled"]) == ("Completed", "Completed")


def test_completed_job_starts_the_queued_manifest_with_the_lineage_s_steps(settings: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job and a queued one
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])

    # WHEN the first completes
    decision = finish(settings, first, "Completed")

    # THEN the queued job starts, training on to the lineage's steps so far plus its own
    assert decision == StartDecision("started", second)
    assert sagemaker.created == [first, second]
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"  # 2 done + 2 of the stage
    assert channel_uri(sagemaker.request(second)) == manifest_uri(settings, second)
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (second, [])
    assert (job(settings, second)["status"], job(settings, second)["steps_base"]) == ("Requested", 2)
    assert trained(settings) == [sid(1), sid(2)]


def test_under_skip_a_completed_job_claims_the_pending_shards(configure: Callable[..., TrainingSettings],
                                                              sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_CONCURRENCY="skip")
    first = seal(settings, 1, 2, 3, 4)[1].job_name

    decision = finish(settings, first, "Completed")

    second = job_name_for(expected_manifest(settings, [3, 4], sequence=2))
    assert decision == StartDecision("started", second, 2)
    assert sagemaker.created == [first, second]
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"


def test_next_job_after_a_completed_one_trains_on_to_the_lineage_total(settings: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")

    second = seal(settings, 3, 4)[1].job_name

    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"
    assert sagemaker.request(second)["CheckpointConfig"] == sagemaker.request(first)["CheckpointConfig"]


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_failed_or_stopped_job_returns_its_shards_and_a_new_job_takes_them(
        status: str, settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job
    first = seal(settings, 1, 2)[1].job_name

    # WHEN it fails (a timed-out job ends Stopped)
    decision = finish(settings, first, status, "AlgorithmError: loss became NaN at step 1200")

    # THEN its record keeps the reason, and its shards are claimed again by a job of another name
    retry = job_name_for(expected_manifest(settings, [1, 2], sequence=2))
    assert retry != first
    assert decision == StartDecision("started", retry, 2)
    assert (job(settings, first)["status"], job(settings, first)["failure_reason"]) == (
        status, "AlgorithmError: loss became NaN at step 1200")
    assert sagemaker.created == [first, retry]
    assert stored_manifest(settings, retry).shards == stored_manifest(settings, first).shards
    assert [shard_item(settings, n)["manifest_job"] for n in (1, 2)] == [retry, retry]
    assert sagemaker.request(retry)["HyperParameters"]["steps"] == "2"  # nothing was trained
    assert lineage(settings)["running_job"] == retry


def test_failed_job_s_shards_go_back_to_pending_and_the_lock_is_released(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job, and a quota raised since (so its two shards alone start nothing)
    first = seal(configure(), 1, 2)[1].job_name
    settings = configure(TRAINING_QUOTA="4")

    # WHEN it fails
    decision = finish(settings, first, "Failed", "InternalServerError")

    # THEN its shards are pending again, in the index, and the lineage is free
    assert decision == StartDecision("waiting", None, 2)
    assert pending(settings) == [sid(1), sid(2)]
    assert [(shard_item(settings, n)["status"], "manifest_job" in shard_item(settings, n)) for n in (1, 2)] \
        == [("pending", False)] * 2
    assert lineage(settings)["running_job"] == ""
    assert sagemaker.created == [first]


def test_queued_job_starts_when_the_running_one_fails(settings: TrainingSettings,
                                                      sagemaker: FakeSageMaker) -> None:
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])

    decision = finish(settings, first, "Failed", "InternalServerError")

    assert decision == StartDecision("started", second)
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "2"  # nothing trained yet
    assert pending(settings) == [sid(1), sid(2)]


def test_duplicate_completed_event_settles_once(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a completed job whose queued successor has started
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])
    finish(settings, first, "Completed")

    # WHEN the Completed event arrives again
    again = finish(settings, first, "Completed")

    # THEN nothing moves: no new job, the same steps, the successor still holds the lock
    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [first, second]
    assert lineage(settings)["steps_done"] == 2
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (second, [])
    assert trained(settings) == [sid(1), sid(2)]
    assert [shard_item(settings, n)["manifest_job"] for n in (3, 4)] == [second, second]


def test_late_duplicate_completed_event_does_not_set_the_lineage_s_steps_back(settings: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    # GIVEN two jobs that completed one after the other (2 steps each)
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])
    finish(settings, first, "Completed")
    finish(settings, second, "Completed")
    assert lineage(settings)["steps_done"] == 4

    # WHEN the first job's Completed event arrives once more
    finish(settings, first, "Completed")

    # THEN the lineage keeps its total, so the next job resumes from step 4, not 2
    assert lineage(settings)["steps_done"] == 4
    assert sagemaker.created == [first, second]


def test_duplicate_failed_event_does_not_take_shards_from_their_new_job(settings: TrainingSettings,
                                                                        sagemaker: FakeSageMaker) -> None:
    first = seal(settings, 1, 2)[1].job_name
    retry = finish(settings, first, "Failed", "InternalServerError").job_name

    again = finish(settings, first, "Failed", "InternalServerError")

    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [first, retry]
    assert [(shard_item(settings, n)["status"], shard_item(settings, n)["manifest_job"]) for n in (1, 2)] \
        == [("claimed", retry)] * 2
    assert pending(settings) == []
    assert lineage(settings)["running_job"] == retry


def test_end_of_a_job_not_in_the_table_is_not_ours(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    seal(settings, 1)
    stranger = "atelier-3f9a1c2b7d4e5f6a8b9c"  # events/deploy_job_*.json

    assert finish(settings, stranger, "Completed") == StartDecision("not-ours", stranger)
    assert pending(settings) == [sid(1)]
    assert sagemaker.requests == []


def test_end_of_another_lineage_s_job_is_not_ours(configure: Callable[..., TrainingSettings],
                                                  sagemaker: FakeSageMaker) -> None:
    other = configure(TRAINING_LINEAGE="faces")
    name = seal(other, 1, 2)[1].job_name
    main = configure(TRAINING_LINEAGE="main")

    assert finish(main, name, "Completed") == StartDecision("not-ours", name)
    assert [shard_item(other, n)["status"] for n in (1, 2)] == ["claimed", "claimed"]


# --- a run plan: one job per stage, chained ---------------------------------------------------------

def test_completed_first_stage_starts_the_second_with_its_instances(configure: Callable[..., TrainingSettings],
                                                                    sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name

    # WHEN stage 0 completes
    finish(settings, base, "Completed")

    # THEN `<base>-s1` runs stage 1 on the same manifest, resuming the lineage's checkpoints
    s1 = f"{base}-s1"
    assert sagemaker.created == [base, s1]
    first, second = sagemaker.request(base), sagemaker.request(s1)
    assert (first["ResourceConfig"]["InstanceType"], first["ResourceConfig"]["InstanceCount"]) == ("ml.m5.xlarge", 1)
    assert (second["ResourceConfig"]["InstanceType"], second["ResourceConfig"]["InstanceCount"]) == ("ml.m5.2xlarge", 2)
    assert first["HyperParameters"] == {"steps": "3", "batch-size": "2", "resolution": "32", "model-config": "tiny"}
    assert second["HyperParameters"] == {"steps": "8", "batch-size": "2", "resolution": "64", "model-config": "tiny",
                                         "first-step": "4"}
    assert channel_uri(second) == channel_uri(first) == manifest_uri(settings, base)
    assert second["CheckpointConfig"] == first["CheckpointConfig"]
    assert (tags(first)["atelier:stage"], tags(first)["atelier:final-stage"]) == ("lo", "false")
    assert (tags(second)["atelier:stage"], tags(second)["atelier:final-stage"]) == ("hi", "true")
    assert tags(second)["atelier:manifest"] == tags(first)["atelier:manifest"]
    # AND the shards are not trained until the last stage is done
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["claimed", "claimed"]
    assert (lineage(settings)["running_job"], lineage(settings)["steps_done"]) == (s1, 0)
    assert (job(settings, s1)["stage"], job(settings, s1)["shards"]) == (1, [sid(1), sid(2)])


def test_completed_last_stage_trains_the_shards_and_frees_the_lineage(configure: Callable[..., TrainingSettings],
                                                                      sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")

    finish(settings, f"{base}-s1", "Completed")

    assert trained(settings) == [sid(1), sid(2)]
    assert (lineage(settings)["running_job"], lineage(settings)["steps_done"]) == ("", 8)
    assert sagemaker.created == [base, f"{base}-s1"]


def test_next_manifest_s_stages_train_on_from_the_lineage_total(configure: Callable[..., TrainingSettings],
                                                                sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")
    finish(settings, f"{base}-s1", "Completed")

    following = seal(settings, 3, 4)[1].job_name
    finish(settings, following, "Completed")

    assert sagemaker.request(following)["HyperParameters"]["steps"] == "11"  # 8 + 3
    assert sagemaker.request(f"{following}-s1")["HyperParameters"]["steps"] == "16"  # 8 + 3 + 5
    # and each job names the lineage step its stage starts at, where its warm-up counts from (1: named by none)
    jobs = (base, f"{base}-s1", following, f"{following}-s1")
    assert [sagemaker.request(name)["HyperParameters"].get("first-step") for name in jobs] == [None, "4", "9", "12"]


def test_duplicate_completed_event_of_a_stage_starts_its_successor_once(configure: Callable[..., TrainingSettings],
                                                                        sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")

    again = finish(settings, base, "Completed")

    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [base, f"{base}-s1"]
    assert lineage(settings)["running_job"] == f"{base}-s1"


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_failed_later_stage_returns_the_shards_to_pending(status: str, configure: Callable[..., TrainingSettings],
                                                          sagemaker: FakeSageMaker) -> None:
    # GIVEN a manifest whose first stage completed and whose second stage runs
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")
    higher = configure(TRAINING_QUOTA="4")  # so the returned shards alone start nothing

    # WHEN the second stage fails
    finish(higher, f"{base}-s1", status, "InternalServerError")

    # THEN no shard is lost: both are pending again and the lineage is free
    assert pending(settings) == [sid(1), sid(2)]
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["pending"] * 2
    assert lineage(settings)["running_job"] == ""


# --- name collisions ----------------------------------------------------------------------------

def test_existing_job_of_our_name_on_another_manifest_is_a_collision(settings: TrainingSettings,
                                                                     sagemaker: FakeSageMaker) -> None:
    # GIVEN a job of the name our manifest will get, created for another ManifestFile
    name = job_name_for(expected_manifest(settings, [1, 2]))
    on_shard_sealed(sealed(settings, 1), settings)
    request = {"TrainingJobName": name, "RoleArn": settings.role_arn,
               "AlgorithmSpecification": {"TrainingImage": settings.image_uri, "TrainingInputMode": "FastFile"},
               "InputDataConfig": [{"ChannelName": "train", "DataSource": {"S3DataSource": {
                   "S3DataType": "ManifestFile", "S3Uri": "s3://elsewhere/manifests/other.manifest"}}}],
               "OutputDataConfig": {"S3OutputPath": "s3://elsewhere/"},
               "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
               "StoppingCondition": {"MaxRuntimeInSeconds": 60}}
    sagemaker.create_training_job(**request)

    # WHEN the quota is reached, THEN the stage refuses to take that job for ours
    with pytest.raises(JobNameCollision, match=name):
        on_shard_sealed(sealed(settings, 2), settings)
    assert channel_uri(sagemaker.request(name)) == "s3://elsewhere/manifests/other.manifest"


def test_existing_job_of_our_name_on_our_manifest_is_ours(settings: TrainingSettings,
                                                          sagemaker: FakeSageMaker) -> None:
    name = seal(settings, 1, 2)[1].job_name

    assert seal(settings, 2) == [StartDecision("already-claimed", name)]
    assert sagemaker.created == [name]


# --- replay -------------------------------------------------------------------------------------

def test_follow_up_manifest_mixes_in_shards_of_the_completed_job(configure: Callable[..., TrainingSettings],
                                                                 sagemaker: FakeSageMaker) -> None:
    # GIVEN half of each follow-up job replayed, and a first job that completed on shards 1 and 2
    settings = configure(TRAINING_REPLAY_SHARE="0.5")
    first = seal(settings, 1, 2)[1].job_name
    assert stored_manifest(settings, first) == expected_manifest(settings, [1, 2])  # nothing to replay yet
    finish(settings, first, "Completed")

    # WHEN shards 3 and 4 reach the quota
    second = seal(settings, 3, 4)[1].job_name

    # THEN the manifest lists them as new and 1 and 2 as replay; the job reads all four
    assert stored_manifest(settings, second) == expected_manifest(settings, [3, 4], replay=(1, 2), sequence=2)
    body = json.loads(aws.read_object(settings.data_bucket, f"manifests/{second}.manifest"))
    assert body == [{"prefix": f"s3://{settings.data_bucket}/shards/"}] + [f"{sid(n)}.tar" for n in (3, 4, 1, 2)]
    assert (job(settings, second)["shards"], job(settings, second)["replay"]) == ([sid(3), sid(4)], [sid(1), sid(2)])
    assert sagemaker.created == [first, second]


def test_failed_follow_up_returns_only_its_new_shards(configure: Callable[..., TrainingSettings],
                                                      sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_REPLAY_SHARE="0.5", TRAINING_QUOTA="3")
    first = seal(settings, 1, 2, 3)[2].job_name
    finish(settings, first, "Completed")
    second = seal(settings, 4, 5, 6)[2].job_name

    finish(settings, second, "Failed", "AlgorithmError")

    # the replayed shards stay trained; the new ones are claimed again under a new name
    assert trained(settings) == [sid(1), sid(2), sid(3)]
    retry = lineage(settings)["running_job"]
    assert retry not in ("", second)
    assert job(settings, retry)["shards"] == [sid(4), sid(5), sid(6)]


def test_completed_follow_up_marks_only_its_new_shards_trained(configure: Callable[..., TrainingSettings],
                                                               sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_REPLAY_SHARE="0.5")
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")
    second = seal(settings, 3, 4)[1].job_name

    finish(settings, second, "Completed")

    assert trained(settings) == [sid(n) for n in (1, 2, 3, 4)]
    assert [ShardRef.model_validate_json(shard_item(settings, n)["ref"]).role for n in (1, 2, 3, 4)] == ["new"] * 4
    assert lineage(settings)["steps_done"] == 4


# --- the handler --------------------------------------------------------------------------------

def handle(event: dict[str, Any], context: Any) -> dict[str, Any]:
    from start_training.app import lambda_handler
    return lambda_handler(event, context)


def test_handler_counts_a_shard_sealed_event(settings: TrainingSettings, lambda_context: Any) -> None:
    event = load_event("start_training_shard_sealed")

    assert handle(event, lambda_context) == {"action": "waiting", "job": None}
    assert pending(settings) == [event["detail"]["shard_id"]]


@pytest.mark.parametrize("name", ["deploy_job_completed", "deploy_job_failed"])
def test_handler_leaves_the_end_of_a_job_it_did_not_start(name: str, settings: TrainingSettings,
                                                          sagemaker: FakeSageMaker, lambda_context: Any) -> None:
    event = load_event(name)

    assert handle(event, lambda_context) == {"action": "not-ours", "job": event["detail"]["TrainingJobName"]}
    assert sagemaker.requests == []


def test_handler_settles_the_end_of_its_own_job(settings: TrainingSettings, sagemaker: FakeSageMaker,
                                               lambda_context: Any) -> None:
    # GIVEN a job this stage started, and SageMaker's Failed event for it
    name = seal(settings, 1, 2)[1].job_name
    event = load_event("deploy_job_failed")
    event["detail"]["TrainingJobName"] = name

    result = handle(event, lambda_context)

    retry = job_name_for(expected_manifest(settings, [1, 2], sequence=2))
    assert result == {"action": "started", "job": retry}
    assert job(settings, name)["failure_reason"] == "AlgorithmError: loss became NaN at step 1200"


@pytest.mark.parametrize("status", ["Completed", "Failed"])
def test_a_job_s_end_changes_only_its_status_settled_and_failure_reason(status: str, settings: TrainingSettings,
                                                                       sagemaker: FakeSageMaker,
                                                                       lambda_context: Any) -> None:
    # GIVEN a job this stage started; DeployFunction, on the same event, writes only its model_data (test_deploy.py)
    name = seal(settings, 1, 2)[1].job_name
    before = job(settings, name)
    event = load_event("deploy_job_failed")
    event["detail"].update(TrainingJobName=name, TrainingJobStatus=status)

    handle(event, lambda_context)

    after = job(settings, name)
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == {
        "status", "settled", "failure_reason"}


# --- latent shards: an encode job before each stage ---------------------------------------------------

ENCODING = "0123456789abcdef-r32"  # <encoder identity>-r<resolution>, as trainer/data/latents.py names it


@pytest.fixture
def encoding(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge")


def put_latents(settings: TrainingSettings, job_name: str, *numbers: int, encoding: str = ENCODING) -> None:
    """What the encode job's CheckpointConfig uploads: a latent twin per shard (and a shard of a
    retried attempt still under its temporary name)."""
    s3 = boto3.client("s3")
    prefix = f"encoded/{job_name}/latents/{encoding}"
    for n in numbers:
        s3.put_object(Bucket=settings.models_bucket, Key=f"{prefix}/{sid(n)}.tar", Body=b"latent shard")
    s3.put_object(Bucket=settings.models_bucket, Key=f"{prefix}/.tmp-{sid(99)}.tar", Body=b"half written")


def test_with_an_encode_instance_the_quota_starts_the_encode_job_first(encoding: TrainingSettings,
                                                                      sagemaker: FakeSageMaker) -> None:
    decision = seal(encoding, 1, 2)[1]

    name = job_name_for(expected_manifest(encoding, [1, 2]))
    request = sagemaker.request(f"{name}-enc")
    assert decision == StartDecision("started", name, 2)
    assert sagemaker.created == [f"{name}-enc"]  # the training job waits for its latents
    assert request["HyperParameters"] == {"task": "encode", "resolution": "32", "model-config": "tiny"}
    assert channel_uri(request) == manifest_uri(encoding, name)
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train"]  # nothing excluded: no manifest channel
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "ShardedByS3Key"
    assert (request["ResourceConfig"]["InstanceType"], request["ResourceConfig"]["InstanceCount"]) == ("ml.g5.2xlarge", 1)
    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{encoding.models_bucket}/encoded/{name}/"
    assert request["OutputDataConfig"]["S3OutputPath"] == f"s3://{encoding.models_bucket}/encoded/"
    assert {k: tags(request)[k] for k in ("atelier:role", "atelier:final-stage", "atelier:training-job")} == {
        "atelier:role": "encode", "atelier:final-stage": "false", "atelier:training-job": name}
    assert (lineage(encoding)["running_job"], job(encoding, name)["status"]) == (name, "Requested")


def test_completed_encode_job_starts_training_on_a_manifest_of_the_latent_shards(encoding: TrainingSettings,
                                                                                 sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)

    decision = finish(encoding, f"{name}-enc", "Completed")

    latents = f"s3://{encoding.data_bucket}/manifests/{name}.latents.manifest"
    assert decision == StartDecision("encoded", name)
    assert sagemaker.created == [f"{name}-enc", name]
    assert channel_uri(sagemaker.request(name)) == latents
    assert json.loads(aws.read_object(encoding.data_bucket, f"manifests/{name}.latents.manifest")) == [
        {"prefix": f"s3://{encoding.models_bucket}/encoded/{name}/latents/{ENCODING}/"}, f"{sid(1)}.tar", f"{sid(2)}.tar"]
    assert sagemaker.request(name)["HyperParameters"] == {"steps": "2", "batch-size": "2", "resolution": "32",
                                                          "model-config": "tiny"}
    assert job(encoding, name)["latents"] == latents
    assert job(encoding, f"{name}-enc")["status"] == "Completed"


def test_duplicate_encode_completed_event_starts_the_training_job_once(encoding: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)

    finish(encoding, f"{name}-enc", "Completed")
    finish(encoding, f"{name}-enc", "Completed")

    assert sagemaker.created == [f"{name}-enc", name]
    assert lineage(encoding)["running_job"] == name


def test_an_encode_job_that_left_a_shard_out_fails_its_training_job(configure: Callable[..., TrainingSettings],
                                                                    sagemaker: FakeSageMaker) -> None:
    name = seal(configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge"), 1, 2)[1].job_name
    settings = configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge", TRAINING_QUOTA="4")  # nothing re-claims them
    put_latents(settings, name, 1)

    decision = finish(settings, f"{name}-enc", "Completed")

    assert decision == StartDecision("encode-failed", name)
    assert sagemaker.created == [f"{name}-enc"]  # never trained on half the manifest
    record = job(settings, name)
    assert record["status"] == "Failed"
    assert f"1 of 2 shards have no latent shard under s3://{settings.models_bucket}/encoded/{name}/latents/{ENCODING}/" \
        in record["failure_reason"]
    assert pending(settings) == [sid(1), sid(2)] and lineage(settings)["running_job"] == ""


def test_latents_of_two_encodings_are_refused(encoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    put_latents(encoding, name, 1, 2, encoding="fedcba9876543210-r32")

    assert finish(encoding, f"{name}-enc", "Completed") == StartDecision("encode-failed", name)

    assert "expected one encoding" in job(encoding, name)["failure_reason"]


def test_a_failed_encode_job_returns_the_shards_and_a_new_job_encodes_them(encoding: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name

    decision = finish(encoding, f"{name}-enc", "Failed", "AlgorithmError: CUDA out of memory")

    retry = job_name_for(expected_manifest(encoding, [1, 2], sequence=2))
    assert decision == StartDecision("encode-failed", name)
    assert job(encoding, name)["failure_reason"] == f"encode job {name}-enc Failed: AlgorithmError: CUDA out of memory"
    assert sagemaker.created == [f"{name}-enc", f"{retry}-enc"]
    assert [shard_item(encoding, n)["manifest_job"] for n in (1, 2)] == [retry, retry]


def test_an_encode_job_whose_end_event_was_lost_is_settled_by_the_next_event(encoding: TrainingSettings,
                                                                            sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    sagemaker.jobs[f"{name}-enc"]["TrainingJobStatus"] = "Completed"  # its event never came

    seal(encoding, 3)  # any later event of the lineage looks at the running job

    assert sagemaker.created == [f"{name}-enc", name]
    assert job(encoding, f"{name}-enc")["status"] == "Completed"


def test_each_stage_is_encoded_at_its_own_resolution(configure: Callable[..., TrainingSettings],
                                                     sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES, TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge")
    base = seal(settings, 1, 2)[1].job_name
    put_latents(settings, base, 1, 2)
    finish(settings, f"{base}-enc", "Completed")

    finish(settings, base, "Completed")  # stage 0 done

    s1 = f"{base}-s1"
    assert sagemaker.created == [f"{base}-enc", base, f"{s1}-enc"]  # stage 1 waits for latents at 64 px
    assert sagemaker.request(f"{s1}-enc")["HyperParameters"] == {"task": "encode", "resolution": "64",
                                                                   "model-config": "tiny"}
    assert "latents" not in job(settings, s1)
    put_latents(settings, s1, 1, 2, encoding="0123456789abcdef-r64")
    finish(settings, f"{s1}-enc", "Completed")
    assert channel_uri(sagemaker.request(s1)) == f"s3://{settings.data_bucket}/manifests/{s1}.latents.manifest"


def test_the_handler_counts_an_encode_job_s_end_and_starts_its_training_job(encoding: TrainingSettings,
                                                                           sagemaker: FakeSageMaker,
                                                                           lambda_context: Any) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    event = load_event("start_training_encode_completed")
    event["detail"]["TrainingJobName"] = f"{name}-enc"

    assert handle(event, lambda_context) == {"action": "encoded", "job": name}
    assert sagemaker.created == [f"{name}-enc", name]


# --- the brake on failing jobs (core.start_training.failure_brake) -------------------------------------------------

NOW = 1_800_000_000.0
MODEL_FAILURE = "AlgorithmError: unrecognized arguments: --learning-rat 1e-4"
CAPACITY_FAILURE = "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The orchestration's time, moved by the test: clock[0] is now."""
    now = [NOW]
    monkeypatch.setattr(starter, "_now", lambda: now[0])
    return now


def test_a_failed_job_backs_off_and_the_schedule_starts_the_next_after_the_wait(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600")
    first = seal(settings, 1, 2)[1].job_name

    # WHEN the job fails
    decision = finish(settings, first, "Failed", MODEL_FAILURE)

    # THEN nothing starts for the backoff, its shards wait in the pending index, the reason is kept
    assert decision == StartDecision("backing-off") and sagemaker.created == [first]
    assert pending(settings) == [sid(1), sid(2)]
    assert (lineage(settings)["not_before"], lineage(settings)["failures"][-1]["reason"]) == (NOW + 600, MODEL_FAILURE)
    clock[0] = NOW + 599
    assert advance(settings) == StartDecision("backing-off") and sagemaker.created == [first]
    # AND the schedule's look after the wait starts the retry on the same shards
    clock[0] = NOW + 600
    retry = advance(settings)
    assert retry.action == "started" and sagemaker.created == [first, retry.job_name]


def test_the_backoff_doubles_with_each_failure_in_a_row(configure: Callable[..., TrainingSettings],
                                                          sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600", TRAINING_MAX_CONSECUTIVE_FAILURES="5")
    name = seal(settings, 1, 2)[1].job_name
    waits = []
    for _ in range(3):
        finish(settings, name, "Failed", MODEL_FAILURE)
        waits.append(float(lineage(settings)["not_before"]) - clock[0])
        clock[0] = float(lineage(settings)["not_before"])
        name = advance(settings).job_name

    assert waits == [600, 1200, 2400]


def test_three_model_failures_in_a_row_halt_the_lineage_until_it_is_resumed(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float],
        stack: Provisioned) -> None:
    from atelier import client, operator_requests
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="3")  # backoff 0 (tests/conftest.py)
    name = seal(settings, 1, 2)[1].job_name
    decisions = []
    for n in range(3):  # a bad hyperparameter fails every job the same way
        decisions.append(finish(settings, name, "Failed", f"{MODEL_FAILURE} (attempt {n})"))
        name = decisions[-1].job_name

    # THEN the third failure halts it: no fourth job, however many events come
    assert [d.action for d in decisions] == ["started", "started", "halted"]
    assert seal(settings, 3, 4)[-1].action == "halted" and advance(settings) == StartDecision("halted")
    assert len(sagemaker.created) == 3
    record = lineage(settings)
    assert (record["halted"], record["model_failures"]) == (True, 3)
    assert [f["reason"] for f in record["failures"]] == [f"{MODEL_FAILURE} (attempt {n})" for n in range(3)]
    assert pending(settings) == [sid(n) for n in (1, 2, 3, 4)]  # nothing lost
    held = next(line for line in client.pipeline_status(stack.outputs).lineages if line["name"] == "main")["held"]
    assert held.startswith("halted after 3 failed jobs in a row") and "(attempt 2)" in held

    # WHEN an operator resumes it (`atelier lineage resume main`)
    resumed = operator_requests.resume_lineage(stack.outputs, "main")

    # THEN the CLI changed nothing itself: StartTrainingFunction, given its event, lifts the brake and
    # starts the next job; the failures stay on record
    assert (resumed["was_halted"], resumed["model_failures"]) == (True, 3)
    assert lineage(settings)["halted"] is True and advance(settings) == StartDecision("halted")
    assert resume(settings).action == "started" and len(sagemaker.created) == 4
    assert (lineage(settings)["halted"], len(lineage(settings)["failures"])) == (False, 3)


def test_capacity_failures_back_off_but_never_halt(configure: Callable[..., TrainingSettings],
                                                    sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="2", TRAINING_FAILURE_BACKOFF_S="60")
    name = seal(settings, 1, 2)[1].job_name
    for _ in range(4):
        assert finish(settings, name, "Failed", CAPACITY_FAILURE) == StartDecision("backing-off")
        clock[0] = float(lineage(settings)["not_before"])
        name = advance(settings).job_name

    record = lineage(settings)
    assert (record["halted"], record["model_failures"], record["failures_in_a_row"]) == (False, 0, 4)
    assert {f["kind"] for f in record["failures"]} == {"capacity"} and len(sagemaker.created) == 5


def test_a_quota_refusal_fails_the_job_as_a_capacity_failure_and_backs_off(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="300")
    sagemaker.quota_left = 0

    # WHEN the quota refuses CreateTrainingJob (no exception escapes: EventBridge would retry it for a day)
    decisions = seal(settings, 1, 2)

    # THEN the job is recorded failed with the reason, its shards wait, the lineage backs off
    name = job_name_for(expected_manifest(settings, [1, 2]))
    assert job(settings, name)["status"] == "Failed"
    assert job(settings, name)["failure_reason"].startswith("ResourceLimitExceeded: The account-level service limit")
    assert pending(settings) == [sid(1), sid(2)] and sagemaker.created == []
    assert lineage(settings)["failures"][-1]["kind"] == "capacity" and lineage(settings)["model_failures"] == 0
    assert decisions[-1] == StartDecision("backing-off", name, 2) and advance(settings) == StartDecision("backing-off")
    # AND once the quota allows it, the retry after the wait runs
    sagemaker.quota_left, clock[0] = 1, NOW + 300
    assert advance(settings).action == "started" and len(sagemaker.created) == 1


def test_a_completed_job_releases_the_brake_and_keeps_the_failures_on_record(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="3")
    name = seal(settings, 1, 2)[1].job_name
    for _ in range(2):
        name = finish(settings, name, "Failed", MODEL_FAILURE).job_name
    finish(settings, name, "Completed")

    record = lineage(settings)
    assert (record["model_failures"], record["failures_in_a_row"], record["halted"]) == (0, 0, False)
    assert len(record["failures"]) == 2


def test_a_stopped_job_is_no_failure(configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker,
                                     clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600")
    first = seal(settings, 1, 2)[1].job_name

    decision = finish(settings, first, "Stopped", "stopped by an operator")

    assert decision.action == "started" and lineage(settings).get("failures_in_a_row", 0) == 0
