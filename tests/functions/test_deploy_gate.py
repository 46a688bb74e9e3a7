"""core.deploy's gate: a first model's rollout, evaluating again on request, the loss limit, the training report."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Callable

import boto3
import pytest
from PIL import Image

from atelier import reports
from atelier.local.provision import Provisioned
from contracts.messages import LeftOut
from core import aws
from core.deploy.candidates import on_job_state, reevaluate
from core.errors import BadMessage
from core.provenance import JobSource, Lineage, ManifestSource, SampleSource, ShardSource
from core.deploy.settings import DeploySettings
from tests.unit.settings_helpers import DEPLOY_REQUIRED
from tests.functions.deploy_helpers import (  # noqa: F401  (settings: fixtures)
    JOB,
    MODELS,
    completed,
    deploy_first,
    evaluation_finished,
    model_record,
    put_eval_shard,
    settings,
    training_jobs,
)
from trainer.report.write import write_report


# --- the gate -----------------------------------------------------------------------------------

def test_a_passing_first_model_creates_the_endpoint_with_a_safe_rollout(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)

    result = on_job_state(evaluation_finished(settings, JOB, 0.1), settings)

    sagemaker = boto3.client("sagemaker")
    model = sagemaker.describe_model(ModelName=JOB)
    record = model_record(settings, JOB)
    assert (result.action, result.model) == ("created", JOB)
    assert sagemaker.describe_endpoint(EndpointName=settings.endpoint_name)["EndpointConfigName"] == JOB
    assert model["PrimaryContainer"]["Environment"] == {
        "ATELIER_MODEL_ID": JOB, "ATELIER_MANIFEST_DIGEST": "ab" * 32,
        "ATELIER_ATTRIBUTION_URI": f"s3://{settings.models_bucket}/training/{JOB}/output/attribution.json"}
    assert record["status"] == "deployed"
    assert json.loads(record["gate"])["decision"] == "passed"
    beside = aws.read_json_if_exists(settings.models_bucket, f"training/{JOB}/output/evaluation.json")
    assert (beside["gate"]["decision"], beside["model"]) == ("passed", JOB)  # for the training report


def test_without_an_evaluation_set_no_evaluation_job_starts_and_the_reason_says_how_to_add_one(
        settings: DeploySettings) -> None:
    bucket, _, prefix = settings.eval_data_uri.removeprefix("s3://").partition("/")
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"{prefix}heldout.tar")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}README.txt", Body=b"not a shard")

    result = on_job_state(completed(), settings)

    record = model_record(settings, JOB)
    assert (result.action, record["status"]) == ("eval-failed", "eval-failed")
    assert settings.eval_data_uri in record["reason"] and "atelier evalset add" in record["reason"]
    assert training_jobs() == []
    assert aws.describe_endpoint(settings.endpoint_name) is None


def test_an_eval_failed_model_is_evaluated_again_on_request_once_the_set_exists(settings: DeploySettings) -> None:
    # GIVEN a candidate that found no held-out set
    bucket, _, prefix = settings.eval_data_uri.removeprefix("s3://").partition("/")
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"{prefix}heldout.tar")
    on_job_state(completed(), settings)
    assert f"`atelier evaluate {JOB}`" in model_record(settings, JOB)["reason"]
    # WHEN the set is added and the evaluation requested again
    put_eval_shard(settings.eval_data_uri)
    result = reevaluate(JOB, settings)

    # THEN a new evaluation job scores it, and its result goes through the gate as any other
    record = model_record(settings, JOB)
    assert (result.action, record["status"], record["eval_job"], record["eval_attempt"]) == (
        "evaluating", "evaluating", f"{JOB}-ev1", 1)
    assert training_jobs() == [f"{JOB}-ev1"]
    assert on_job_state(evaluation_finished(settings, JOB, 0.1), settings).action == "created"


def test_a_request_to_evaluate_again_leaves_a_model_that_is_not_eval_failed_alone(settings: DeploySettings) -> None:
    deploy_first(settings)

    result = reevaluate(JOB, settings)

    assert (result.action, model_record(settings, JOB)["status"]) == ("duplicate", "deployed")
    assert training_jobs() == [f"{JOB}-eval"]


def test_a_second_request_while_the_first_evaluates_starts_nothing(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)
    on_job_state(evaluation_finished(settings, JOB, 0.1, status="Failed"), settings)

    first, second = reevaluate(JOB, settings), reevaluate(JOB, settings)

    assert (first.action, second.action) == ("evaluating", "duplicate")
    assert training_jobs() == [f"{JOB}-ev1", f"{JOB}-eval"]


def test_a_request_for_an_unknown_model_is_a_bad_message(settings: DeploySettings) -> None:
    with pytest.raises(BadMessage, match="no model 'atelier-nope'"):
        reevaluate("atelier-nope", settings)


def test_the_cli_asks_the_deploy_function_only_for_an_eval_failed_model(settings: DeploySettings, stack: Provisioned,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from atelier import client, operator_requests
    sent: list[tuple] = []
    monkeypatch.setattr(aws, "put_event", lambda *args: sent.append(args))
    on_job_state(completed(), settings)
    with pytest.raises(client.PipelineError, match="is evaluating: only an eval-failed model"):
        operator_requests.evaluate(stack.outputs, JOB)
    with pytest.raises(client.PipelineError, match="no model 'atelier-nope'"):
        operator_requests.evaluate(stack.outputs, "atelier-nope")
    on_job_state(evaluation_finished(settings, JOB, 0.1, status="Failed"), settings)

    result = operator_requests.evaluate(stack.outputs, JOB)

    assert sent == [("default", "atelier.cli", "Evaluate Model", json.dumps({"model": JOB}))]
    assert (result["attempt"], result["previous_reason"]) == (0, f"evaluation {JOB}-eval Failed: AlgorithmError: no eval shards")


def test_a_loss_above_the_limit_is_held_back_and_kept(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)

    result = on_job_state(evaluation_finished(settings, JOB, settings.gate_max_loss * 2), settings)

    record = model_record(settings, JOB)
    assert result.action == "held-back"
    assert (record["status"], record["model_data"]) == ("held-back", f"{MODELS}/training/{JOB}/output/model.tar.gz")
    assert "above the limit" in record["reason"]
    assert aws.describe_endpoint(settings.endpoint_name) is None


def trainer_output(tmp_path: Path) -> bytes:
    """output.tar.gz as SageMaker uploads the trainer's output data dir (trainer/report/write.py writes it)."""
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    model_dir.mkdir()
    history = [{"step": s, "loss": 1.0 / s, "img_per_s": 50.0 + s, "data_wait_share": 0.02} for s in (2, 4)]
    (model_dir / "atelier-training.json").write_text(json.dumps({"steps": 4, "final_loss": 0.25, "history": history}))
    (data_dir / "validation").mkdir(parents=True)
    Image.new("RGB", (32, 16), "red").save(data_dir / "validation" / "step-00000004.png")
    write_report(model_dir, data_dir, job=JOB)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(data_dir, arcname=".")
    return buffer.getvalue()


def lineage_document(job: str) -> Lineage:
    """lineage.json of a model that learned from one manifest of two partners' samples (core.provenance)."""
    shard = ShardSource(shard_id="s1", key="shards/s1.tar", sha256="c" * 64, role="new", samples=3, excluded=1,
                        index_uri="s3://data/shards/s1.json")
    manifest = ManifestSource(sequence=7, digest="ab" * 32, uri="s3://data/manifests/m.json",
                              jobs=(JobSource(name=job, stage=0, status="Completed"),), shards=(shard,),
                              left_out=(LeftOut(shard_id="s1", sha256="d" * 64, partner="partner-b", reason="revoked"),))
    samples = tuple(SampleSource(sha256=f"{n}" * 64, partner=p, license="CC-BY-4.0", bucket="uploads", key=f"{p}/{n}.png",
                                 version_id="", shards=("s1",), manifests=(7,)) for n, p in ((1, "partner-a"), (2, "partner-b")))
    return Lineage(job=job, lineage="main", manifest="ab" * 32, artifact=f"{MODELS}/training/{job}/output/model.tar.gz",
                   manifests=(manifest,), samples=samples)


def test_after_the_gate_the_job_s_report_is_the_whole_page_the_run_the_decision_the_lineage(
        settings: DeploySettings, stack: Provisioned, tmp_path: Path) -> None:
    # GIVEN a finished job's output data and its lineage.json, as the trainer and start-training leave them
    s3, folder = boto3.client("s3"), f"training/{JOB}/output"
    s3.put_object(Bucket=settings.models_bucket, Key=f"{folder}/output.tar.gz", Body=trainer_output(tmp_path))
    s3.put_object(Bucket=settings.models_bucket, Key=f"{folder}/lineage.json",
                  Body=lineage_document(JOB).model_dump_json())
    on_job_state(completed(), settings)

    # WHEN the gate holds the model back, and `atelier report --job` renders the job's report
    assert on_job_state(evaluation_finished(settings, JOB, settings.gate_max_loss * 2), settings).action == "held-back"
    page = reports.job_report(stack.outputs, JOB).decode()

    # THEN it is the whole page: the run, the decision, the lineage summary
    assert f"Training report: {JOB}" in page and page.count("<polyline") == 3
    assert 'alt="validation grid step-00000004"' in page
    assert '<span class="fail">held-back</span>' in page and "above the limit" in page
    assert f"#7 abababababab: jobs {JOB}; shards 1, left out 1" in page
    assert "partner-a / CC-BY-4.0: 1, partner-b / CC-BY-4.0: 1" in page and "no lineage.json" not in page


def test_a_passing_model_s_report_says_passed_even_without_the_job_s_output_data(settings: DeploySettings,
                                                                                stack: Provisioned) -> None:
    deploy_first(settings)

    page = reports.job_report(stack.outputs, JOB).decode()
    assert '<span class="pass">passed</span>' in page and "no lineage.json" in page


def test_the_gate_writes_evaluation_json_beside_the_artefact_and_reads_none_of_the_job_s_output(
        settings: DeploySettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a finished job's output data and lineage.json beside its artefact, and every S3 read recorded
    s3, folder = boto3.client("s3"), f"training/{JOB}/output"
    s3.put_object(Bucket=settings.models_bucket, Key=f"{folder}/output.tar.gz", Body=trainer_output(tmp_path))
    s3.put_object(Bucket=settings.models_bucket, Key=f"{folder}/lineage.json",
                  Body=lineage_document(JOB).model_dump_json())
    read: list[str] = []
    for name in ("head_object", "open_object", "read_object", "read_json_if_exists", "read_prefix_if_exists",
                 "read_prefix_with_etag", "read_range"):
        monkeypatch.setattr(aws, name, recording(getattr(aws, name), read, lambda bucket, key, *_, **__: key))
    monkeypatch.setattr(aws, "read_tar_member", recording(aws.read_tar_member, read, lambda uri, *_, **__: uri))
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=settings.models_bucket, Prefix=folder)["Contents"]}

    # WHEN the model passes the gate and is deployed
    deploy_first(settings)

    # THEN of the job's folder the deploy function read nothing, and wrote evaluation.json alone
    now = {o["Key"] for o in s3.list_objects_v2(Bucket=settings.models_bucket, Prefix=folder)["Contents"]}
    assert now - listed == {f"{folder}/evaluation.json"}
    assert read == [f"s3://{settings.models_bucket}/evaluations/{JOB}-eval/output/model.tar.gz"]  # the scores


def recording(real: Callable[..., Any], read: list[str], what: Callable[..., str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        read.append(what(*args, **kwargs))
        return real(*args, **kwargs)
    return call
