"""EMF metrics and correlated log lines, as the functions print them (core/telemetry.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tarfile
from typing import Any, Callable

import boto3
import pytest
from aws_lambda_powertools import Logger, Metrics

from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from atelier.local.template import Resolver, expand
from contracts import job_tags
from core import telemetry
from core.ingest import admission
from core.pack.packer import pack_samples
from tests.functions.ingest_helpers import ingest_through_queue
from tests.functions.pack_helpers import settings_for, upload_sample
from tests.support import ACCOUNT, IMAGES, REGION, REPO, STACK, load_event, sagemaker_job

RED = encode(picture("circle", "red", "blue"), "png")


@pytest.fixture
def emf(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[dict]]:
    """The EMF blobs printed from here on (the shared metric buffer starts empty)."""
    monkeypatch.setenv("POWERTOOLS_METRICS_NAMESPACE", "Atelier")
    telemetry.metrics.clear_metrics()
    capsys.readouterr()

    def blobs() -> list[dict]:
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
        return lines
    return blobs


@pytest.fixture
def core_log() -> Any:
    """The lines the core's loggers write (they log through their service's Logger, as in Lambda)."""
    parent = Logger(service=admission.logger.service, stream=sys.__stdout__)  # or the one that exists
    buffer = io.StringIO()
    capture = logging.StreamHandler(buffer)
    capture.setFormatter(parent.registered_formatter)
    parent._logger.addHandler(capture)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    parent._logger.removeHandler(capture)


def values(blobs: list[dict], name: str, **dimensions: str) -> list[float]:
    """Every value of one metric with exactly these dimensions (besides `service`)."""
    found = []
    for blob in blobs:
        (directive,) = blob["_aws"]["CloudWatchMetrics"]
        names = {m["Name"] for m in directive["Metrics"]}
        keys = set(directive["Dimensions"][0]) - {"service"}
        if name in names and keys == set(dimensions) and all(blob[k] == v for k, v in dimensions.items()):
            found += blob[name]
    return found


@pytest.fixture
def ingest_handler(stack: Provisioned, partner: str, function_env: Callable, lambda_context: Any):
    function_env("IngestFunction")
    from ingest.app import lambda_handler
    return lambda uploads: ingest_through_queue(stack, lambda_handler, lambda_context, uploads)


def test_ingest_counts_accepted_duplicate_and_rejected_by_reason(ingest_handler, emf) -> None:
    ingest_handler({"partner-a/red.png": RED, "partner-a/again.png": RED, "partner-a/notes.png": b"not an image"})
    blobs = emf()

    assert sum(values(blobs, telemetry.UPLOADS_ACCEPTED)) == 1
    assert sum(values(blobs, telemetry.UPLOADS_DUPLICATE)) == 1
    assert values(blobs, telemetry.UPLOADS_REJECTED, reason="duplicate") == [1.0]
    assert values(blobs, telemetry.UPLOADS_REJECTED, reason="not_an_image") == [1.0]
    assert {b["_aws"]["CloudWatchMetrics"][0]["Namespace"] for b in blobs} == {"Atelier"}
    assert {b["service"] for b in blobs} == {"ingest"}


def test_ingest_log_lines_carry_the_upload_key_as_correlation_id(ingest_handler, emf, core_log) -> None:
    ingest_handler({"partner-a/red.png": RED, "partner-a/notes.png": b"not an image"})
    lines = core_log()

    assert {(line["message"], line.get("correlation_id")) for line in lines} >= {
        ("upload accepted", "partner-a/red.png"), ("upload quarantined", "partner-a/notes.png")}


def test_pack_counts_samples_bytes_shards_and_the_upload_to_shard_latency(stack, emf, core_log, monkeypatch) -> None:
    # GIVEN three accepted samples uploaded at a known time, shards of two samples (and small parts)
    import moto.s3.models
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)
    settings = settings_for(stack, shard_max_samples=2)
    samples = [upload_sample(stack, n) for n in range(3)]
    # WHEN they are packed and the buffer is flushed, as the handler's @metrics.log_metrics does
    report = pack_samples([(f"m{n}", s) for n, s in enumerate(samples)], settings)
    Metrics(namespace="Atelier").flush_metrics()  # one buffer per process, whichever instance flushes it
    blobs = emf()
    # THEN
    assert sum(values(blobs, telemetry.SAMPLES_PACKED)) == 3
    assert sum(values(blobs, telemetry.SHARDS_SEALED)) == len(report.sealed) == 1
    assert values(blobs, telemetry.SHARD_BYTES) == [report.sealed[0].size]
    latencies = values(blobs, telemetry.UPLOAD_TO_SHARD_SECONDS)
    assert len(latencies) == 3 and all(value > 0 for value in latencies)
    packed = {line["correlation_id"]: line["sha256"] for line in core_log() if line["message"] == "sample packed"}
    assert packed == {s.key: s.sha256 for s in samples}


def test_sweep_counts_the_uploads_it_re_drives_and_the_runs_it_defers(stack, function_env, lambda_context, emf,
                                                                       monkeypatch) -> None:
    # GIVEN two uploads whose notifications were never sent, and SweepFunction's environment with no grace period
    s3, bucket, lost = boto3.client("s3"), stack.outputs["UploadsBucketName"], ["partner-a/a.png", "partner-a/b.png"]
    s3.put_bucket_notification_configuration(Bucket=bucket, NotificationConfiguration={})
    for key in lost:
        s3.put_object(Bucket=bucket, Key=key, Body=RED)
    function_env("SweepFunction")
    monkeypatch.setenv("SWEEP_GRACE_S", "0")
    from sweep.app import lambda_handler
    tick = {"source": "aws.events", "detail-type": "Scheduled Event"}
    # WHEN the sweep re-drives them, then runs again while both messages wait in UploadsQueue (limit 1)
    assert sorted(lambda_handler(tick, lambda_context)["redriven"]) == lost
    monkeypatch.setenv("SWEEP_MAX_QUEUE_DEPTH", "1")
    assert lambda_handler(tick, lambda_context)["deferred_queue_depth"] >= len(lost)
    blobs = emf()
    # THEN one EMF line per run, under the names the runbook and docs/reliability.md give
    assert values(blobs, "UploadsRedriven") == [2.0, 0.0]
    assert values(blobs, "SweepsDeferred") == [1.0]


def test_nothing_is_recorded_without_a_namespace(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("POWERTOOLS_METRICS_NAMESPACE", raising=False)
    telemetry.metrics.clear_metrics()
    telemetry.count(telemetry.SAMPLES_PACKED)
    telemetry.count_by(telemetry.UPLOADS_REJECTED, telemetry.REASON, "empty")

    assert telemetry.metrics.metric_set == {} and capsys.readouterr().out == ""


def test_seconds_since_reads_s3_event_times() -> None:
    from datetime import datetime, timezone
    now = datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)

    assert telemetry.seconds_since("2026-01-01T00:00:00.000Z", now) == 60.0
    assert telemetry.seconds_since("", now) is None


# --- training jobs and deployments, through their handlers --------------------------------------------

@pytest.fixture
def start_training(stack: Provisioned, partner: str, function_env: Callable, lambda_context: Any) -> Callable:
    """StartTrainingFunction's handler in its template environment (quota 2; moto's SageMaker)."""
    function_env("StartTrainingFunction")
    from start_training.app import lambda_handler
    return lambda event: lambda_handler(event, lambda_context)


def shard_sealed(n: int) -> dict:
    """events/start_training_shard_sealed.json for shard n of partner-a (registered, so screened in)."""
    event = load_event("start_training_shard_sealed")
    shard_id = f"shard-{n:032x}"
    event["detail"].update(shard_id=shard_id, key=f"shards/{shard_id}.tar", sha256=f"{n:064x}", partners=["partner-a"])
    return event


def job_ended(name: str, status: str) -> dict:
    """SageMaker's state-change event for a training job (the rule sends it to both functions)."""
    event = load_event("deploy_job_failed")
    event["detail"].update(TrainingJobName=name, TrainingJobStatus=status, SecondaryStatus=status)
    return event


def test_start_training_counts_the_job_it_starts(start_training, emf) -> None:
    waiting = start_training(shard_sealed(1))
    assert (waiting["action"], values(emf(), telemetry.TRAINING_JOBS_STARTED)) == ("waiting", [])

    started = start_training(shard_sealed(2))  # the quota is reached

    assert started["action"] == "started"
    assert values(emf(), telemetry.TRAINING_JOBS_STARTED) == [1.0]


def test_start_training_counts_a_failed_job_once_per_event(start_training, emf) -> None:
    # GIVEN a job the pipeline started
    start_training(shard_sealed(1))
    job = start_training(shard_sealed(2))["job"]
    emf()
    # WHEN it fails
    after = start_training(job_ended(job, "Failed"))
    # THEN one failure is counted, and a start only if its shards went straight into a new job
    blobs = emf()
    assert values(blobs, telemetry.TRAINING_JOBS_FINISHED["Failed"]) == [1.0]
    assert values(blobs, telemetry.TRAINING_JOBS_STARTED) == ([1.0] if after["action"] == "started" else [])
    assert values(blobs, telemetry.TRAINING_JOBS_FINISHED["Completed"]) == []


def test_start_training_counts_a_lineage_halted_once_for_the_alarm(start_training, emf, monkeypatch) -> None:
    # GIVEN the breaker set to open at the second failed job in a row (backoff 0: tests/conftest.py)
    monkeypatch.setenv("TRAINING_MAX_CONSECUTIVE_FAILURES", "2")
    start_training(shard_sealed(1))
    job = start_training(shard_sealed(2))["job"]
    emf()
    # WHEN its job and the retry fail
    retry = start_training(job_ended(job, "Failed"))["job"]
    first = emf()
    halted = start_training(job_ended(retry, "Failed"))
    # THEN LineagesHalted (LineageHaltedAlarm's metric) is counted with the second failure, not the first
    assert values(first, telemetry.LINEAGES_HALTED) == []
    assert (halted["action"], values(emf(), telemetry.LINEAGES_HALTED)) == ("halted", [1.0])
    # AND a redelivered Failed event counts it no more
    start_training(job_ended(retry, "Failed"))
    assert values(emf(), telemetry.LINEAGES_HALTED) == []


def test_start_training_does_not_count_jobs_it_did_not_start(start_training, emf) -> None:
    assert start_training(job_ended("atelier-3f9a1c2b7d4e5f6a8b9c-eval", "Failed"))["action"] == "not-ours"

    assert values(emf(), telemetry.TRAINING_JOBS_FINISHED["Failed"]) == []


def evaluation_artefact(event: dict, val_loss: float) -> None:
    """The evaluation.json (in model.tar.gz) an evaluation job leaves where its event points."""
    document = json.dumps({"schema": 1, "eval_set": {"digest": "e" * 64, "samples": 4},
                           "models": {"candidate": {"val_loss": val_loss, "clip_score": None}}}).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("evaluation.json")
        info.size = len(document)
        archive.addfile(info, io.BytesIO(document))
    bucket, key = event["detail"]["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("s3://").split("/", 1)
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


def test_deploy_counts_the_deployment_of_a_model_that_passed_the_gate(stack: Provisioned, function_env: Callable,
                                                                      lambda_context: Any, emf) -> None:
    # GIVEN a held-out set, and a completed final-stage training job (its event carries no tags: the
    # handler reads SageMaker's) whose evaluation the handler starts
    env = function_env("DeployFunction")
    bucket, _, prefix = env["EVAL_DATA_URI"].removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}heldout.tar", Body=bytes(1024))
    job = load_event("deploy_job_completed")["detail"]["TrainingJobName"]
    sagemaker_job(job, f"s3://{env['MODELS_BUCKET']}/training/", {job_tags.MANIFEST: "ab" * 32, job_tags.FINAL_PLANNED_JOB: "true"})
    from deploy.app import lambda_handler
    assert lambda_handler(load_event("deploy_job_completed"), lambda_context)["action"] == "evaluating"
    assert values(emf(), telemetry.DEPLOYMENTS) == []
    # WHEN the evaluation ends with a loss under the gate's limit
    finished = load_event("deploy_evaluation_completed")
    evaluation_artefact(finished, val_loss=0.1)
    result = lambda_handler(finished, lambda_context)
    # THEN the endpoint is created and one deployment counted
    blobs = emf()
    assert result["action"] == "created"
    assert values(blobs, telemetry.DEPLOYMENTS) == [1.0]
    assert values(blobs, telemetry.MODELS_EVALUATED) == [1.0]
    assert values(blobs, telemetry.MODELS_HELD_BACK) == []


# --- X-Ray: on in Lambda only -------------------------------------------------------------------------

TRACED = ["deploy.app", "import_shard.app", "pack.app", "start_training.app", "sweep.app"]  # docs/architecture.md
LAMBDA_MARKERS = ("LAMBDA_TASK_ROOT", "AWS_SAM_LOCAL", "POWERTOOLS_TRACE_DISABLED")


@pytest.mark.parametrize(("where", "markers", "tracing"), [
    # atelier/local/worker.py: the template's environment and AWS_LAMBDA_FUNCTION_NAME, no LAMBDA_TASK_ROOT
    ("local stack", {}, False),
    ("sam local invoke", {"LAMBDA_TASK_ROOT": "/var/task", "AWS_SAM_LOCAL": "true"}, False),
    ("Lambda", {"LAMBDA_TASK_ROOT": "/var/task"}, True),
])
def test_the_functions_trace_only_in_lambda(where: str, markers: dict, tracing: bool) -> None:
    # GIVEN a fresh interpreter (Powertools decides once per process) with a function's environment
    expanded = expand(REPO / "template.yaml", IMAGES, STACK, REGION, ACCOUNT)
    resolver = Resolver(expanded.parameters, expanded.conditions, mappings=expanded.mappings, ref=lambda name: name, get_att=lambda name, _: name)
    template_env = resolver.resolve(expanded.resources["PackFunction"]["Properties"]["Environment"]["Variables"])
    env = {k: v for k, v in os.environ.items() if k not in LAMBDA_MARKERS}
    env |= {k: str(v) for k, v in template_env.items()} | {"AWS_LAMBDA_FUNCTION_NAME": "atelier-pack"} | markers
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "functions"), str(REPO)])
    probe = ("import importlib, json, sys, aws_xray_sdk; "
             "on = {m: not importlib.import_module(m).tracer.disabled for m in sys.argv[1:]}; "
             "print(json.dumps([on, aws_xray_sdk.global_sdk_config.sdk_enabled()]))")
    # WHEN the traced functions' modules are imported
    run = subprocess.run([sys.executable, "-c", probe, *TRACED], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    # THEN their tracer (and the X-Ray SDK) is on in Lambda alone: nowhere else is a daemon listening
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [{m: tracing for m in TRACED}, tracing]


def test_an_error_inside_correlated_in_a_script_is_not_chained_to_the_missing_logger() -> None:
    # A script or bench has no service Logger(): the body's own error must be the one reported,
    # not "during handling of OrphanedChildLoggerError".
    code = ("from core import telemetry\n"
            "try:\n"
            "    with telemetry.correlated('shard-1'):\n"
            "        raise ValueError('boom')\n"
            "except ValueError as error:\n"
            "    print(type(error.__context__).__name__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "functions")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "NoneType"
