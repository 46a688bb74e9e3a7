"""Chaos on the whole local stack: nothing lost, nothing duplicated, every shard intact.

One stack, several seeded runs. In each, 20..40 generated pictures (and a broken file and an exact
duplicate, both to be quarantined) are uploaded while the workers die at random AWS requests
(raise, kill -> cold start, stall past the function's Timeout so the runtime's timeout fires
mid-batch) and deliveries are shuffled, repeated, duplicated late and lose their deletes
(atelier/local/chaos.py); each run also sends UploadsQueue one message ingest can never parse (poison).
Then the faults stop and nobody touches a DLQ: RedriveFunction, on its schedule, sends transient
dead letters back and holds poison ones. Once the pipeline is quiet `atelier.audit` must find every
upload quarantined or in exactly one sealed, byte-exact shard; every shard must read back with
tarfile and webdataset; every DLQ must be empty but UploadsDLQ, which must hold exactly the poison
messages, each marked with the contract error that proves it poison. Timeouts and visibility timeouts are
a few seconds (property overrides) so a crashed batch comes back quickly; samples pack over two
lanes; training never starts (TrainingQuota 1000). ATELIER_CHAOS_RUNS=N runs more; ATELIER_CHAOS_SEED=S replays a seed's draws
(the interleaving with real time is not replayed).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from atelier import client, dlq
from atelier.local import traffic
from atelier.local.chaos import ChaosConfig
from atelier.local.stack import LocalStack, StackOptions
from contracts import pipeline_table
from core import aws
from atelier import audit
from core.redrive import dead_letters

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=170)]
REPO = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("ATELIER_CHAOS_RUNS", "3"))
SEED = int(os.environ.get("ATELIER_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 31))))
PARTNER = "chaos"
OVERRIDES = {"TrainingQuota": "1000", "PackBatchSize": "8", "PackBatchWindowSeconds": "1",
             "PackLanes": "2"}  # two open shards (tests/functions/test_pack_faults.py races two packers over lanes)
ENVIRONMENT = {"SHARD_MAX_AGE_S": "4", "SHARD_MAX_SAMPLES": "8",
               "DEAD_LETTER_BACKOFF_S": "2"}  # the redriver runs every 3 s  # two open shards (tests/functions/test_pack_faults.py races two packers over lanes)
# Lambda timeouts and visibility timeouts of seconds, not minutes: a crashed batch is back soon.
PROPERTIES = {"IngestFunction": {"Timeout": 6}, "PackFunction": {"Timeout": 8}, "StartTrainingFunction": {"Timeout": 6},
              "SweepFunction": {"Timeout": 6}, "RedriveFunction": {"Timeout": 10}, "UploadsQueue": {"VisibilityTimeout": 8},
              "PackQueue": {"VisibilityTimeout": 10}}
POISON_DLQ = "UploadsDLQ"  # where the runs' poison messages must end, and stay
QUIET_S = 180


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    state = tmp_path_factory.mktemp("chaos")
    chaos_file = state / "chaos.json"
    _configure(chaos_file, ChaosConfig())
    options = StackOptions(root=REPO, state_dir=state, moto_port=0, sagemaker_port=0, overrides=OVERRIDES,
                           environment=ENVIRONMENT, property_overrides=PROPERTIES, schedule_scale=0.05, chaos_file=chaos_file)
    with LocalStack(options) as stack:
        yield stack


def runtime_timeouts(stack: LocalStack, stalls: int) -> int:
    """The runtime's "Task timed out" lines. A stall injected in the storm's last seconds (a timer's
    tick) may still be sleeping towards its function's Timeout: wait that long at most."""
    deadline = time.monotonic() + max(p.get("Timeout", 0) for p in PROPERTIES.values()) + 5
    while True:
        count = sum(p.read_text(errors="replace").count("Task timed out")
                    for p in (stack.options.state_dir / "logs").glob("*.log"))
        if count >= stalls or time.monotonic() > deadline:
            return count
        time.sleep(1)


@pytest.fixture(autouse=True)
def stack_env(chaos_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 at the local stack again (the shared fixtures clear AWS_ENDPOINT_URL*)."""
    for key, value in chaos_stack.env.items():
        monkeypatch.setenv(key, value)
    aws.reset_clients()


def test_storms_lose_and_duplicate_nothing(chaos_stack: LocalStack) -> None:
    stack, outputs = chaos_stack, chaos_stack.outputs
    chaos_file = stack.options.chaos_file
    assert chaos_file is not None
    print(f"chaos seed {SEED} (ATELIER_CHAOS_SEED={SEED} replays the draws), {RUNS} runs")
    client.add_partner(outputs, PARTNER, ["CC-BY-4.0"], [], "chaos test")
    began, clock = _utc_now(), time.monotonic()
    totals: Counter[str] = Counter()
    for run in range(RUNS):
        totals += _storm(stack, chaos_file, SEED + run)
    # THEN over all runs: every upload's fate is sound, every shard reads back, the DLQs are clean
    report = _audit(outputs, began)
    assert report.ok, [v.model_dump() for v in report.violations]
    assert report.pending == [] and report.shards_verified == report.shards > 0
    assert (report.uploads, report.accepted, report.quarantined) == (totals["uploads"], totals["accepted"],
                                                                     totals["quarantined"])
    shards = traffic.sealed(outputs["PipelineTableName"])
    assert [p for shard in shards for p in traffic.read_back(shard)] == []
    assert sum(s.samples for s in shards) == totals["accepted"]
    # AND every DLQ is empty but for the poison messages, which stay, each marked with its proof
    held = {name: _dead_letters(outputs[f"{name}Url"], RUNS if name == POISON_DLQ else 0) for name in dlq.queues(outputs)}
    assert {name: len(m) for name, m in held.items() if m} == {POISON_DLQ: RUNS}, held
    assert sorted(body for body, _ in held[POISON_DLQ]) == sorted(_poison(SEED + run) for run in range(RUNS))
    for body, marks in held[POISON_DLQ]:
        assert marks[dead_letters.VERDICT_ATTRIBUTE] == dead_letters.POISON, body
        assert marks[dead_letters.ERROR_ATTRIBUTE].startswith(
            "poison: does not match its queue's contract: not JSON: Expecting value"), marks
    redriven = sum(int(item["redrives"]) for item in aws.scan_prefix(outputs["PipelineTableName"], pipeline_table.REDRIVE_PREFIX))
    faults = Counter(json.loads(line)["fault"] for line in chaos_file.with_name("chaos.json.log").read_text().splitlines())
    timeouts = runtime_timeouts(stack, faults["stall"])
    summary = {"test": "chaos", "seed": SEED, "runs": RUNS, "seconds": round(time.monotonic() - clock, 1),
               "uploads": report.uploads, "accepted": report.accepted, "quarantined": report.quarantined,
               "shards": report.shards, "lost": sum(v.kind == "lost" for v in report.violations),
               "duplicated": sum(v.kind == "duplicated" for v in report.violations),
               "faults": dict(sorted(faults.items())), "faults_total": sum(faults.values()),
               "runtime_timeouts": timeouts, "dlq_redriven_automatically": redriven, "dlq_poison_held": RUNS}
    print(json.dumps(summary))
    assert faults["raise"] + faults["kill"] + faults["stall"] > 0 and faults["duplicate"] > 0
    assert timeouts >= faults["stall"]  # every stall ended in the runtime's timeout


def _storm(stack: LocalStack, chaos_file: Path, seed: int) -> Counter[str]:
    """One run: uploads under faults, then calm, redrive and quiet; its audit must be clean."""
    outputs, rng = stack.outputs, random.Random(seed)
    # GIVEN faults at every boundary
    _configure(chaos_file, ChaosConfig(
        enabled=True, seed=seed, crash_rate=0.35, max_call=rng.randint(4, 24), shuffle=True, redeliver_rate=0.15,
        duplicate_rate=0.1, max_delay_s=4, lose_delete_rate=0.1))
    began = _utc_now()
    good = traffic.uploads(PARTNER, rng.randint(20, 40), seed, sidecar_share=0.3)
    bad = [traffic.Upload(f"{PARTNER}/{seed}/broken.jpg", b"not a picture at all"),
           traffic.Upload(f"{PARTNER}/{seed}/copy-of-first.{good[0].key.rsplit('.', 1)[1]}", good[0].body)]
    # WHEN they are uploaded and the storm has run its course
    for upload in good + bad:
        traffic.put(outputs["UploadsBucketName"], upload)
    aws.send_message(outputs["UploadsQueueUrl"], _poison(seed))  # fails every receive, then its redrives
    queues = [outputs["UploadsQueueUrl"], outputs["PackQueueUrl"]]
    traffic.wait_until(lambda: traffic.queue_depth(queues) == 0, QUIET_S, check=stack.check)
    _configure(chaos_file, ChaosConfig(enabled=False, seed=seed))
    # nobody redrives: the redriver must empty the DLQs of everything but poison by itself
    poison_so_far = seed - SEED + 1
    quiet = traffic.wait_until(lambda: traffic.queue_depth(queues) == 0 and not _audit(outputs, began, False).pending
                               and _settled(outputs, poison_so_far), QUIET_S, check=stack.check)
    # THEN every upload is quarantined or in exactly one sound shard
    report = _audit(outputs, began)
    assert quiet, f"seed {seed}: still pending after {QUIET_S} s: {[p.model_dump() for p in report.pending]}"
    assert report.ok, f"seed {seed}: {[v.model_dump() for v in report.violations]}"
    assert (report.uploads, report.accepted, report.quarantined) == (len(good) + 2, len(good), 2), f"seed {seed}"
    return Counter(uploads=report.uploads, accepted=report.accepted, quarantined=report.quarantined)


def _poison(seed: int) -> str:
    return f"poison {seed}: not an S3 notification"


def _settled(outputs: dict[str, str], poison: int) -> bool:
    """Every DLQ empty, waiting messages included, but the poison ones in POISON_DLQ."""
    depths = {name: traffic.queue_depth([url]) for name, url in dlq.queues(outputs).items()}
    return depths == {name: poison if name == POISON_DLQ else 0 for name in depths}


def _dead_letters(url: str, expected: int) -> list[tuple[str, dict[str, str]]]:
    """A DLQ's messages with their string attributes, each made visible again once all are received.
    The redriver keeps running: a run that has just received the poison hides it for a moment, and a
    message that reached the DLQ since its last run carries no verdict yet. So the read is repeated
    (for a while) until `expected` messages were seen, each with a verdict; more are always reported."""
    deadline = time.monotonic() + 30
    while (len(found := _read_all(url)) < expected or not all(dead_letters.VERDICT_ATTRIBUTE in marks
                                                               for _, marks in found)) \
            and time.monotonic() < deadline:
        time.sleep(1)
    return found


def _read_all(url: str) -> list[tuple[str, dict[str, str]]]:
    sqs, found = aws.client("sqs"), {}
    while batch := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=30,
                                       MessageAttributeNames=["All"]).get("Messages"):
        found.update({m["MessageId"]: m for m in batch})
    for message in found.values():
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0)
    return [(m["Body"], {k: v["StringValue"] for k, v in m.get("MessageAttributes", {}).items() if "StringValue" in v})
            for m in found.values()]


def _audit(outputs: dict[str, str], since: datetime, verify_bytes: bool = True) -> audit.Report:
    targets = audit.Targets(outputs["UploadsBucketName"], outputs["DataBucketName"], outputs["PipelineTableName"])
    return audit.gather(targets, since, _utc_now() + timedelta(minutes=5), grace_s=3600, verify_bytes=verify_bytes)


def _configure(chaos_file: Path, config: ChaosConfig) -> None:
    """Replace the chaos file at once (the workers read it whenever it changes)."""
    partial = chaos_file.with_suffix(".tmp")
    partial.write_text(json.dumps(asdict(config)))
    partial.replace(chaos_file)


def _utc_now() -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=1)  # S3 LastModified has whole seconds
