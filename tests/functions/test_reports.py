"""`atelier report` and `atelier status` against the pipeline's own records (moto)."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest

from atelier import cli, client
from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from contracts import job_tags, pipeline_table
from contracts.messages import Sample
from core import aws
from core.deploy.candidates import on_job_state
from core.deploy.events import JobState
from core.pack.packer import pack_samples
from core.partners.licensing import Revocation, revoke
from core.deploy.settings import DeploySettings
from core.pack.settings import PackSettings
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished, on_shard_sealed
from tests.functions.ingest_helpers import ingest_through_queue
from tests.functions.pack_helpers import settings_for

RED = encode(picture("circle", "red", "blue"), "png")
GREEN = encode(picture("triangle", "green", "black"), "png")


@pytest.fixture
def outputs(stack: Provisioned, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    return stack.outputs


@dataclass(frozen=True)
class Stages:
    """The pack, start-training and deploy stages' settings from the template, one shard a job."""

    pack: PackSettings
    training: TrainingSettings
    deploy: DeploySettings


@pytest.fixture
def uploaded(stack, partner, function_env: Callable, lambda_context: Any, outputs, monkeypatch) -> dict[str, Sample]:
    """partner-a's uploads through the ingest handler: two good pictures and a non-image; the accepted by key."""
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)
    function_env("IngestFunction")
    from ingest.app import lambda_handler
    ingest_through_queue(stack, lambda_handler, lambda_context,
                         {"partner-a/red.png": RED, "partner-a/green.png": GREEN, "partner-a/notes.png": b"no"})
    accepted = [Sample.model_validate_json(i["record"]) for i in aws.scan_prefix(outputs["PipelineTableName"], "SAMPLE#")]
    return {s.key: s for s in accepted}


@pytest.fixture
def stages(stack, uploaded, function_env: Callable, monkeypatch) -> Stages:
    monkeypatch.setattr(aws, "create_training_job", lambda request: True)  # SageMaker itself is not needed here
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_QUOTA", "1")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0")
    training = TrainingSettings.current()
    function_env("DeployFunction")
    return Stages(settings_for(stack), training, DeploySettings.current())


def train(stages: Stages, samples: list[Sample], ended: int) -> str:
    """The samples packed into one shard, which the start-training stage claims for a job; the job
    completes, and the deploy stage records its model (no held-out set: eval-failed). The job's name."""
    packed = pack_samples([(f"m-{s.sha256[:8]}", s) for s in samples],
                          dataclasses.replace(stages.pack, shard_max_samples=len(samples)))
    (sealed,) = packed.sealed
    job = on_shard_sealed(sealed, stages.training).job_name
    assert job is not None
    on_job_finished(job, "Completed", None, stages.training)
    artefact = f"s3://{stages.deploy.models_bucket}/training/{job}/output/model.tar.gz"
    digest = aws.get_item(stages.training.table, pipeline_table.job_pk(job))["digest"]  # the tags it was started with
    on_job_state(JobState(name=job, status="Completed", model_data_url=artefact, failure_reason=None, ended_at=ended,
                          tags=((job_tags.FINAL_PLANNED_JOB, "true"), (job_tags.MANIFEST, digest))), stages.deploy)
    return job


def partner_report(partner: str, capsys) -> dict[str, Any]:
    capsys.readouterr()
    assert cli.main(["report", "--partner", partner, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_partner_report_lists_accepted_and_rejected_uploads_their_shard_job_and_model(uploaded, stages, capsys) -> None:
    job = train(stages, [uploaded["partner-a/red.png"]], ended=1)

    report = partner_report("partner-a", capsys)

    shard = report["items"][2]["shard"]
    assert (report["uploads"], report["accepted"], report["rejected"], report["packed"]) == (3, 2, {"not_an_image": 1}, 1)
    assert [(i["key"], i["status"], i["reason"], i["jobs"], i["models"]) for i in report["items"]] == [
        ("partner-a/green.png", "accepted", None, [], []),  # not packed yet
        ("partner-a/notes.png", "quarantined", "not_an_image", [], []),
        ("partner-a/red.png", "accepted", None, [job], [job])]
    assert report["shards"] == [{"shard": shard, "status": "trained", "samples": 1, "jobs": [job]}]
    assert report["jobs"] == [{"job": job, "status": "Completed", "model": job}]
    assert report["models"] == [{"model": job, "job": job, "status": "eval-failed", "samples": 1}]


def test_a_later_model_of_the_lineage_holds_what_earlier_jobs_trained_on(uploaded, stages, capsys) -> None:
    # GIVEN a job on the red picture, then a job on the green one that resumes the lineage's checkpoints
    first = train(stages, [uploaded["partner-a/red.png"]], ended=1)
    second = train(stages, [uploaded["partner-a/green.png"]], ended=2)

    # WHEN partner-a's report is made
    report = partner_report("partner-a", capsys)

    # THEN the red picture is in both models, though only the first job read its shard
    models = {i["key"]: (i["jobs"], i["models"]) for i in report["items"]}
    assert models["partner-a/red.png"] == ([first], [first, second])
    assert models["partner-a/green.png"] == ([second], [second])
    assert [(m["model"], m["samples"]) for m in report["models"]] == [(first, 1), (second, 2)]
    assert [(j["job"], j["model"]) for j in report["jobs"]] == [(first, first), (second, second)]


def test_a_sample_the_manifest_left_out_is_in_no_job_and_no_model(uploaded, stages, capsys) -> None:
    # GIVEN a takedown of the green picture, then a job on the shard holding both pictures
    green, red = uploaded["partner-a/green.png"], uploaded["partner-a/red.png"]
    revoke(stages.training.table, Revocation(partner="partner-a", sha256s=(green.sha256,), reason="artist request"))
    job = train(stages, [red, green], ended=1)

    # WHEN partner-a's report is made
    report = partner_report("partner-a", capsys)

    # THEN both are in the shard the job read, but only the red one was trained on and is in its model
    items = {i["key"]: i for i in report["items"]}
    assert items["partner-a/green.png"]["shard"] == items["partner-a/red.png"]["shard"]
    assert (items["partner-a/green.png"]["jobs"], items["partner-a/green.png"]["models"]) == ([], [])
    assert (items["partner-a/red.png"]["jobs"], items["partner-a/red.png"]["models"]) == ([job], [job])


def test_another_partner_s_report_is_empty(uploaded, capsys) -> None:
    assert partner_report("partner-b", capsys)["uploads"] == 0


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
    assert '<span class="fail">held-back</span>' in page  # the deploy gate's decision (core.deploy.evaluations)
    assert "1.200x production" in page and "main" in page and "no lineage.json" not in page
    assert page.count("<svg") >= 2 and "step-00000004" in page


def test_a_job_without_a_report_says_so(outputs, capsys) -> None:
    assert cli.main(["report", "--job", "atelier-none", "-o", "unused.html"]) == 2
    assert "no report.html for job 'atelier-none'" in capsys.readouterr().err.replace("\n", "")


def test_tensorboard_fetches_the_job_s_event_files_and_prints_the_dir_to_open(outputs, tmp_path: Path, capsys) -> None:
    s3, bucket = boto3.client("s3"), outputs["ModelsBucketName"]
    s3.put_object(Bucket=bucket, Key="tensorboard/atelier-0003/events.out.tfevents.1.host", Body=b"events")
    s3.put_object(Bucket=bucket, Key="tensorboard/atelier-0003/run/events.out.tfevents.2.host", Body=b"more")
    s3.put_object(Bucket=bucket, Key="tensorboard/atelier-00031/events.out.tfevents.3.host", Body=b"another job's")

    assert cli.main(["tensorboard", "atelier-0003", "--dir", str(tmp_path / "tb")]) == 0
    files = {p.relative_to(tmp_path / "tb").as_posix(): p.read_bytes() for p in (tmp_path / "tb").rglob("*") if p.is_file()}
    assert files == {"events.out.tfevents.1.host": b"events", "run/events.out.tfevents.2.host": b"more"}
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in capsys.readouterr().out.replace("\n", "")


def test_tensorboard_of_a_job_without_logs_says_so(outputs, capsys) -> None:
    assert cli.main(["tensorboard", "atelier-none"]) == 2
    assert "no TensorBoard files for job 'atelier-none'" in capsys.readouterr().err.replace("\n", "")


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
    client.add_partner(outputs, "partner-a", ["CC-BY-4.0"], [], "")  # upload refuses an unregistered partner
    capsys.readouterr()

    assert cli.main(["--quiet", "upload", str(tmp_path), "--partner", "partner-a"]) == 0
    captured = capsys.readouterr()
    listed = boto3.client("s3").list_objects_v2(Bucket=outputs["UploadsBucketName"])["Contents"]
    assert sorted(o["Key"] for o in listed) == ["partner-a/a.json", "partner-a/a.png"]
    assert captured.err == "" and captured.out.strip() == "2 objects uploaded for partner partner-a"


def test_the_partner_table_shows_each_upload_s_models(uploaded, stages, capsys, monkeypatch) -> None:
    from rich.console import Console

    from atelier import cli_report
    first = train(stages, [uploaded["partner-a/red.png"]], ended=1)
    second = train(stages, [uploaded["partner-a/green.png"]], ended=2)
    monkeypatch.setattr(cli_report, "console", Console(width=400))  # one line per row, nothing cut
    capsys.readouterr()

    assert cli.main(["report", "--partner", "partner-a"]) == 0

    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]][-2:] == ["jobs", "models"]
    rows = {cells[0]: cells for cells in ([cell.strip() for cell in line.split("│")[1:-1]]
                                          for line in lines if line.startswith("│"))}
    assert rows["partner-a/red.png"][-2:] == [first, f"{first}, {second}"]  # in the later model too
    assert rows["partner-a/green.png"][-2:] == [second, second]
    assert rows["partner-a/notes.png"][-1] == ""
