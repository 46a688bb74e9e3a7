"""`atelier report` and `atelier status` against the pipeline's own records (moto)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest

from atelier import cli, client
from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from core import aws, records
from core.pack import pack_samples
from core.models import Sample
from tests.functions.ingest_helpers import ingest_through_queue
from tests.functions.pack_helpers import settings_for

RED = encode(picture("circle", "red", "blue"), "png")


@pytest.fixture
def outputs(stack: Provisioned, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    return stack.outputs


@pytest.fixture
def ingested(stack, partner, function_env: Callable, lambda_context: Any, outputs, monkeypatch) -> Sample:
    """partner-a uploaded one good picture (packed into a shard a job trained on) and one non-image."""
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)
    function_env("IngestFunction")
    from ingest.app import lambda_handler
    ingest_through_queue(stack, lambda_handler, lambda_context, {"partner-a/red.png": RED, "partner-a/notes.png": b"no"})
    (item,) = aws.scan_prefix(outputs["PipelineTableName"], "SAMPLE#")
    sample = Sample.model_validate_json(item["record"])
    (sealed,) = pack_samples([("m1", sample)], settings_for(stack, shard_max_samples=1)).sealed
    aws.put_item(outputs["PipelineTableName"], {**records.shard_item(sealed), "status": "claimed"})
    aws.put_item(outputs["PipelineTableName"], {**records.job_item("atelier-0001", "manifests/atelier-0001.json",
                                                                   [sealed.shard_id], "2026-11-29T12:00:00"),
                                                "status": "Completed", "model_data": "s3://models/m.tar.gz"})
    return sample


def test_partner_report_lists_accepted_and_rejected_uploads_their_shard_and_job(ingested, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["report", "--partner", "partner-a", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    shard = report["items"][1]["shard"]
    assert (report["uploads"], report["accepted"], report["rejected"], report["packed"]) == (2, 1, {"not_an_image": 1}, 1)
    assert [(i["key"], i["status"], i["reason"], i["jobs"]) for i in report["items"]] == [
        ("partner-a/notes.png", "quarantined", "not_an_image", []), ("partner-a/red.png", "accepted", None, ["atelier-0001"])]
    assert report["shards"] == [{"shard": shard, "status": "claimed", "samples": 1, "jobs": ["atelier-0001"]}]
    assert report["jobs"] == [{"job": "atelier-0001", "status": "Completed", "model": "s3://models/m.tar.gz"}]


def test_another_partner_s_report_is_empty(ingested, capsys) -> None:
    capsys.readouterr()
    cli.main(["report", "--partner", "partner-b", "--json"])

    assert json.loads(capsys.readouterr().out)["uploads"] == 0


def output_archive(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_job_report_is_fetched_from_the_job_s_output_data(outputs, tmp_path: Path) -> None:
    page = b"<!DOCTYPE html><title>report</title>"
    boto3.client("s3").put_object(Bucket=outputs["ModelsBucketName"], Key="training/atelier-0001/output/output.tar.gz",
                                  Body=output_archive({"loss.png": b"png", "report.html": page}))

    assert cli.main(["report", "--job", "atelier-0001", "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").read_bytes() == page


def test_job_report_is_rebuilt_with_the_gate_decision_and_lineage_written_after_training(outputs, tmp_path: Path) -> None:
    # GIVEN a finished job's artefacts, then the gate's decision and the lineage beside them
    s3, bucket, prefix = boto3.client("s3"), outputs["ModelsBucketName"], "training/atelier-0002/output/"
    record = {"steps": 4, "final_loss": 0.25, "history": [{"step": 2, "loss": 0.5, "img_per_s": 3.0},
                                                          {"step": 4, "loss": 0.25, "img_per_s": 4.0}]}
    s3.put_object(Bucket=bucket, Key=prefix + "model.tar.gz",
                  Body=output_archive({"atelier-training.json": json.dumps(record).encode(), "unet/w.bin": b"0" * 64}))
    s3.put_object(Bucket=bucket, Key=prefix + "output.tar.gz",
                  Body=output_archive({"validation/step-00000004.png": RED, "report.html": b"<p>at training time</p>"}))
    s3.put_object(Bucket=bucket, Key=prefix + "evaluation.json", Body=json.dumps(
        {"gate": {"decision": "held-back", "reason": "validation loss 0.3000 is 1.200x production's"}}).encode())
    s3.put_object(Bucket=bucket, Key=prefix + "lineage.json", Body=json.dumps({"job": "atelier-0002", "lineage": "main"}).encode())

    # WHEN the report is fetched
    assert cli.main(["report", "--job", "atelier-0002", "-o", str(tmp_path / "r.html")]) == 0

    # THEN it is the trainer's page with both, and the run's curves and grid
    page = (tmp_path / "r.html").read_text()
    assert "Training report: atelier-0002" in page
    assert '<span class="fail">held-back</span>' in page  # the deploy gate's decision (core.deploy)
    assert "1.200x production" in page and "main" in page and "no lineage.json" not in page
    assert page.count("<svg") >= 2 and "step-00000004" in page


def test_a_job_without_a_report_says_so(outputs, capsys) -> None:
    assert cli.main(["report", "--job", "atelier-none", "-o", "unused.html"]) == 2
    assert "no report.html for job 'atelier-none'" in capsys.readouterr().err.replace("\n", "")


def test_status_json_watch_prints_one_json_line_per_refresh(outputs, monkeypatch, capsys) -> None:
    naps = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(cli.time, "sleep", sleep)
    monkeypatch.setattr(client, "_endpoints", lambda name: [])
    capsys.readouterr()

    assert cli.main(["status", "--json", "--watch", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["samples"] == 0 for line in lines) and naps == [0.5, 0.5]


def test_upload_quiet_writes_no_progress_and_uploads_every_file(outputs, tmp_path: Path, capsys) -> None:
    (tmp_path / "a.png").write_bytes(RED)
    (tmp_path / "a.json").write_text('{"caption": "a red circle"}')
    capsys.readouterr()

    assert cli.main(["--quiet", "upload", str(tmp_path), "--partner", "partner-a"]) == 0
    captured = capsys.readouterr()
    listed = boto3.client("s3").list_objects_v2(Bucket=outputs["UploadsBucketName"])["Contents"]
    assert sorted(o["Key"] for o in listed) == ["partner-a/a.json", "partner-a/a.png"]
    assert captured.err == "" and captured.out.strip() == "2 objects uploaded for partner partner-a"
