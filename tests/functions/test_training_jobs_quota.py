"""The start-training stage's quota: one job a quota of shards, redeliveries, queue or skip, racing invocations."""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import boto3
import pytest
from botocore.exceptions import ClientError

from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training import manifests
from core.start_training.manifests import job_name_for, manifest_file
from core.start_training.starter import StartDecision, on_shard_sealed
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
    FakeSageMaker,
    channel_uri,
    configure,
    expected_manifest,
    job,
    lineage,
    manifest_uri,
    pending,
    sagemaker,
    seal,
    sealed,
    settings,
    shard_item,
    sid,
    stack,
    stored_manifest,
    tags,
)


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
                             "atelier:lineage": "main", "atelier:stage": "main", "atelier:final-stage": "true",
                             "atelier:recipe": settings.recipe_digest}  # the stack's recipe (TEST_RECIPE)
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
