"""EMF metrics and correlated log lines, as the functions print them (core/telemetry.py)."""

from __future__ import annotations

import io
import json
import logging
import sys
from typing import Any, Callable

import pytest
from aws_lambda_powertools import Logger, Metrics

from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from core import ingest, telemetry
from core.pack import pack_samples
from tests.functions.ingest_helpers import ingest_through_queue
from tests.functions.pack_helpers import settings_for, upload_sample

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
    parent = Logger(service=ingest.logger.service, stream=sys.__stdout__)  # or the one that exists
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
