"""core.deploy against moto with the template's resources: candidates, the gate, the rollout.

moto runs training jobs to Completed at once and sends no events, and does not implement
UpdateEndpoint: the tests deliver the events themselves (evaluation results as the trainer writes
them) and record UpdateEndpoint calls. tests/e2e/test_deploy.py runs the same steps for real.
"""

from __future__ import annotations

import dataclasses
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
from contracts import job_tags, pipeline_table
from contracts.messages import LeftOut
from core import aws
from core.deploy import candidates
from core.deploy.candidates import on_artefact_published, on_job_state, reevaluate
from core.deploy.events import JobState, job_state_from_event
from core.deploy.requests import (
    deployment_config,
    endpoint_config_request,
    evaluation_job_name,
    evaluation_job_request,
    model_request,
)
from core.deploy.rollout import on_endpoint_state, on_rollback_request, rollback
from core.errors import BadMessage
from core.provenance import JobSource, Lineage, ManifestSource, SampleSource, ShardSource
from core.deploy.settings import DeploySettings
from tests.unit.test_settings import DEPLOY_REQUIRED
from tests.support import load_event, sagemaker_job
from trainer.report.write import write_report

pytestmark = pytest.mark.slow(seconds=25)
JOB = "atelier-3f9a1c2b7d4e5f6a8b9c"  # events/deploy_job_*.json
ENDED = 1795953900000
MODELS = "s3://atelier-models-123456789012-us-east-1"  # the stack's models bucket


@pytest.fixture
def settings(stack: Provisioned, function_env: Callable[[str], dict[str, str]]) -> DeploySettings:
    function_env("DeployFunction")
    found = DeploySettings.from_env()
    put_eval_shard(found.eval_data_uri)
    return found


def put_eval_shard(eval_data_uri: str) -> None:
    """A held-out shard under EvalDataPrefix: without one no evaluation job is started."""
    bucket, _, prefix = eval_data_uri.removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}heldout.tar", Body=bytes(1024))


@pytest.fixture
def updates(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """UpdateEndpoint calls, recorded and applied to moto's endpoint (moto does not implement it)."""
    calls: list[dict[str, Any]] = []
    real_call = aws.sagemaker_call
    real_describe = aws.describe_endpoint
    serving: dict[str, str] = {}

    def call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
        if operation == "update_endpoint":
            calls.append(request)
            serving[request["EndpointName"]] = request["EndpointConfigName"]
            return {}
        return real_call(operation, request)

    def describe(name: str) -> dict[str, Any] | None:
        found = real_describe(name)
        return {**found, "EndpointConfigName": serving.get(name, found["EndpointConfigName"])} if found else None

    monkeypatch.setattr(aws, "sagemaker_call", call)
    monkeypatch.setattr(aws, "describe_endpoint", describe)
    return calls


def completed(name: str = JOB, ended: int = ENDED, **tags: str) -> JobState:
    detail = {**load_event("deploy_job_completed")["detail"], "TrainingJobName": name, "TrainingEndTime": ended,
              "ModelArtifacts": {"S3ModelArtifacts": f"{MODELS}/training/{name}/output/model.tar.gz"},
              "Tags": {"atelier:manifest": "ab" * 32, "atelier:final-stage": "true", **tags}}
    return job_state_from_event(detail)


def evaluation_finished(settings: DeploySettings, model: str, val_loss: float | None,
                        baseline_loss: float | None = None, status: str = "Completed",
                        digest: str = "e" * 64, clip: float | None = None, baseline_clip: float | None = None) -> JobState:
    """The evaluation job's end, with the evaluation.json trainer/jobs/evaluate.py writes in its artefact."""
    item = aws.get_item(settings.table, pipeline_table.model_pk(model)) or {}
    name = item.get("eval_job") or evaluation_job_name(model)
    key = f"evaluations/{name}/output/model.tar.gz"
    models: dict[str, Any] = {"candidate": {"val_loss": val_loss, "clip_score": clip}}
    if baseline_loss is not None:
        models["baseline"] = {"val_loss": baseline_loss, "clip_score": baseline_clip}
    document = json.dumps({"schema": 1, "eval_set": {"digest": digest, "samples": 4}, "models": models}).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("evaluation.json")
        info.size = len(document)
        archive.addfile(info, io.BytesIO(document))
    boto3.client("s3").put_object(Bucket=settings.models_bucket, Key=key, Body=buffer.getvalue())
    return job_state_from_event({
        "TrainingJobName": name, "TrainingJobStatus": status, "TrainingEndTime": ENDED,
        "ModelArtifacts": {"S3ModelArtifacts": f"s3://{settings.models_bucket}/{key}"} if status == "Completed" else None,
        "FailureReason": None if status == "Completed" else "AlgorithmError: no eval shards",
        "Tags": {"atelier:role": "evaluation", "atelier:candidate": model}})


def model_record(settings: DeploySettings, name: str) -> dict[str, Any]:
    return aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}


def training_jobs() -> list[str]:
    return sorted(j["TrainingJobName"] for j in boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"])


def deploy_first(settings: DeploySettings, name: str = JOB, ended: int = ENDED, loss: float = 0.1) -> None:
    """A candidate that passes the gate and creates the endpoint."""
    assert on_job_state(completed(name, ended), settings).action == "evaluating"
    assert on_job_state(evaluation_finished(settings, name, loss), settings).action == "created"


# --- candidates -------------------------------------------------------------------------------------

def test_a_completed_final_job_starts_its_evaluation_on_the_held_out_set(settings: DeploySettings) -> None:
    result = on_job_state(completed(), settings)

    job = boto3.client("sagemaker").describe_training_job(TrainingJobName=f"{JOB}-eval")
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert (result.action, result.model) == ("evaluating", JOB)
    assert channels == {"candidate": f"{MODELS}/training/{JOB}/output/model.tar.gz",
                        "eval": settings.eval_data_uri}  # no production yet: no baseline channel
    assert job["HyperParameters"]["task"] == "evaluate"
    assert model_record(settings, JOB)["status"] == "evaluating"


def test_a_duplicate_completed_event_starts_one_evaluation(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)

    again = on_job_state(completed(), settings)

    assert (again.action, training_jobs()) == ("duplicate", [f"{JOB}-eval"])


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_failed_and_stopped_jobs_are_recorded_and_never_evaluated(settings: DeploySettings, status: str) -> None:
    # GIVEN the pipeline's record of the job
    aws.put_item(settings.table, {"pk": pipeline_table.job_pk(JOB), "status": "InProgress"})
    state = dataclasses.replace(completed(), status=status, failure_reason="MaxRuntimeExceeded")

    result = on_job_state(state, settings)

    assert result.action == "recorded"
    assert aws.get_item(settings.table, pipeline_table.job_pk(JOB))["model_data"] == state.model_data_url
    assert training_jobs() == [] and model_record(settings, JOB) == {}


@pytest.mark.parametrize("status, final_planned_job", [("Completed", True), ("Completed", False), ("Failed", True)])
def test_a_job_s_end_writes_only_model_data_on_its_job_record(settings: DeploySettings, status: str,
                                                              final_planned_job: bool) -> None:
    # GIVEN the job's record as the start-training stage keeps it: its status is that stage's to write
    # (tests/functions/test_training_jobs.py), on the same event
    before = {"pk": pipeline_table.job_pk(JOB), "kind": "job", "status": "InProgress", "manifest": "manifests/m.json",
              "shards": ["s1"], "stage": 0}
    aws.put_item(settings.table, before)
    state = dataclasses.replace(completed(**{"atelier:final-stage": str(final_planned_job).lower()}), status=status,
                                failure_reason=None if status == "Completed" else "AlgorithmError: NaN")

    on_job_state(state, settings)

    assert aws.get_item(settings.table, pipeline_table.job_pk(JOB)) == {
        **before, "model_data": f"{MODELS}/training/{JOB}/output/model.tar.gz"}


def test_a_job_the_pipeline_did_not_start_gets_no_job_record(settings: DeploySettings) -> None:
    # a JOB# record would make the start-training stage treat the job as its own
    on_job_state(dataclasses.replace(completed(), status="Failed"), settings)

    assert aws.get_item(settings.table, pipeline_table.job_pk(JOB)) is None


def test_an_earlier_run_plan_stage_is_recorded_not_evaluated(settings: DeploySettings) -> None:
    result = on_job_state(completed(**{"atelier:final-stage": "false"}), settings)

    assert (result.action, training_jobs()) == ("recorded", [])


def test_the_artefact_of_a_completed_job_is_the_same_candidate_as_its_completed_event(settings: DeploySettings,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("core.deploy.candidates.describe_job", lambda name: completed(name))

    first = on_artefact_published(settings.models_bucket, f"training/{JOB}/output/model.tar.gz", settings)
    second = on_job_state(completed(), settings)

    assert (first.action, second.action, training_jobs()) == ("evaluating", "duplicate", [f"{JOB}-eval"])


def test_the_artefact_of_a_stopped_job_is_never_a_candidate(settings: DeploySettings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # SageMaker uploads a Stopped job's model too
    monkeypatch.setattr("core.deploy.candidates.describe_job", lambda name: dataclasses.replace(completed(name), status="Stopped"))

    result = on_artefact_published(settings.models_bucket, f"training/{JOB}/output/model.tar.gz", settings)

    assert (result.action, training_jobs()) == ("recorded", [])


def test_an_object_that_is_not_a_model_artefact_is_a_bad_message(settings: DeploySettings) -> None:
    with pytest.raises(BadMessage, match="not a training job's model artefact"):
        on_artefact_published(settings.models_bucket, f"training/{JOB}/output/output.tar.gz", settings)


# --- what a job is: its tags, never its name ----------------------------------------------------------

ENCODE_JOB = f"{JOB}-enc"
ENCODE_TAGS = {job_tags.MANIFEST: "ab" * 32, job_tags.LINEAGE: "main", job_tags.PLANNED_JOB: "main",
               job_tags.FINAL_PLANNED_JOB: "false", job_tags.ROLE: "encode", job_tags.TRAINING_JOB: JOB}


def untagged(event_name: str) -> JobState:
    """A job's state change as its event says it, without tags."""
    detail = load_event(event_name)["detail"]
    assert "Tags" not in detail
    return job_state_from_event(detail)


def refusals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reasons the deploy function logs when it refuses to decide about a job."""
    logged: list[str] = []
    monkeypatch.setattr(candidates.logger, "error", lambda message, extra: logged.append(extra["reason"]))
    return logged


def listing_refused(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """SageMaker answers ListTags with this error."""
    def refuse(arn: str) -> dict[str, str]:
        raise aws.ClientError({"Error": {"Code": code, "Message": f"ListTags of {arn} refused"}}, "ListTags")
    monkeypatch.setattr("core.aws.sagemaker.sagemaker_tags", refuse)


def test_an_encode_job_s_event_without_tags_is_what_its_sagemaker_tags_say_never_a_candidate(
        settings: DeploySettings) -> None:
    # GIVEN the encode job as the start-training stage created it, and its Completed event without tags
    sagemaker_job(ENCODE_JOB, f"{MODELS}/encoded/", ENCODE_TAGS)

    result = on_job_state(untagged("deploy_encode_job_completed"), settings)

    assert (result.action, result.model) == ("recorded", None)
    assert training_jobs() == [ENCODE_JOB] and model_record(settings, ENCODE_JOB) == {}


def test_a_final_stage_s_event_without_tags_is_a_candidate_with_its_manifest_from_sagemaker(
        settings: DeploySettings) -> None:
    sagemaker_job(JOB, f"{MODELS}/training/", {job_tags.MANIFEST: "ab" * 32, job_tags.FINAL_PLANNED_JOB: "true"})

    result = on_job_state(untagged("deploy_job_completed"), settings)

    assert (result.action, result.model) == ("evaluating", JOB)
    assert model_record(settings, JOB)["manifest"] == "ab" * 32


def test_a_job_whose_tags_cannot_be_read_is_refused_with_the_reason_logged(
        settings: DeploySettings, monkeypatch: pytest.MonkeyPatch) -> None:
    logged = refusals(monkeypatch)
    # GIVEN a Completed event without tags of a job SageMaker does not know

    result = on_job_state(untagged("deploy_encode_job_completed"), settings)

    assert (result.action, result.model) == ("refused", ENCODE_JOB)
    assert logged == [result.reason] and "cannot be read" in result.reason
    assert training_jobs() == [] and model_record(settings, ENCODE_JOB) == {}


def test_a_job_whose_listed_tags_are_refused_by_sagemaker_is_refused(
        settings: DeploySettings, monkeypatch: pytest.MonkeyPatch) -> None:
    logged = refusals(monkeypatch)
    sagemaker_job(ENCODE_JOB, f"{MODELS}/encoded/", ENCODE_TAGS)

    listing_refused(monkeypatch, "AccessDeniedException")

    result = on_job_state(untagged("deploy_encode_job_completed"), settings)

    assert (result.action, logged) == ("refused", [result.reason]) and "cannot be read" in result.reason
    assert training_jobs() == [ENCODE_JOB] and model_record(settings, ENCODE_JOB) == {}


@pytest.mark.parametrize("tags", [
    {}, {job_tags.MANIFEST: "ab" * 32}, {job_tags.FINAL_PLANNED_JOB: "true"}, {job_tags.FINAL_PLANNED_JOB: "yes", job_tags.MANIFEST: "ab"},
    {job_tags.ROLE: "unheard-of", job_tags.FINAL_PLANNED_JOB: "true", job_tags.MANIFEST: "ab" * 32}])
def test_a_job_whose_tags_do_not_say_what_it_is_is_refused(settings: DeploySettings, monkeypatch: pytest.MonkeyPatch,
                                                            tags: dict[str, str]) -> None:
    logged = refusals(monkeypatch)
    sagemaker_job(JOB, f"{MODELS}/training/", tags)

    result = on_job_state(untagged("deploy_job_completed"), settings)

    assert (result.action, logged) == ("refused", [result.reason]) and "do not say what it is" in result.reason
    assert training_jobs() == [JOB] and model_record(settings, JOB) == {}


def test_an_evaluation_s_event_without_tags_is_judged_as_the_tags_sagemaker_lists_say(
        settings: DeploySettings) -> None:
    on_job_state(completed(), settings)  # its evaluation job is started with the evaluation's tags

    result = on_job_state(dataclasses.replace(evaluation_finished(settings, JOB, 0.1), tags=()), settings)

    assert (result.action, result.model) == ("created", JOB)


def test_an_evaluation_is_known_by_its_tags_never_by_its_name(settings: DeploySettings,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    logged = refusals(monkeypatch)
    # GIVEN a candidate being evaluated, and an untagged event of a job named as its evaluation whose
    # tags SageMaker will not list
    on_job_state(completed(), settings)
    listing_refused(monkeypatch, "ValidationException")

    result = on_job_state(dataclasses.replace(evaluation_finished(settings, JOB, 0.1), tags=()), settings)

    assert (result.action, logged) == ("refused", [result.reason])
    assert model_record(settings, JOB)["status"] == "evaluating"
    assert aws.describe_endpoint(settings.endpoint_name) is None


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


def test_a_non_finite_loss_is_held_back(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)

    result = on_job_state(evaluation_finished(settings, JOB, None), settings)

    assert (result.action, result.reason) == ("held-back", "validation loss is not finite")


def test_a_failed_evaluation_is_never_served(settings: DeploySettings) -> None:
    on_job_state(completed(), settings)

    result = on_job_state(evaluation_finished(settings, JOB, 0.1, status="Failed"), settings)

    assert (result.action, model_record(settings, JOB)["status"]) == ("eval-failed", "eval-failed")
    assert aws.describe_endpoint(settings.endpoint_name) is None


def test_the_second_candidate_is_evaluated_against_production(settings: DeploySettings) -> None:
    deploy_first(settings)

    on_job_state(completed("atelier-second", ENDED + 1000), settings)

    job = boto3.client("sagemaker").describe_training_job(TrainingJobName="atelier-second-eval")
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert channels["baseline"] == f"{MODELS}/training/{JOB}/output/model.tar.gz"


def test_a_model_worse_than_production_is_held_back(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)

    result = on_job_state(evaluation_finished(settings, "atelier-second", 0.2, baseline_loss=0.1), settings)

    assert result.action == "held-back"
    assert "2.000x production's" in result.reason
    assert updates == []
    assert model_record(settings, JOB)["status"] == "deployed"


def test_a_clip_score_far_below_production_is_held_back(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)

    result = on_job_state(evaluation_finished(settings, "atelier-second", 0.1, baseline_loss=0.1,
                                              clip=20.0, baseline_clip=25.0), settings)

    assert result.action == "held-back" and "CLIP score 20.00 trails" in result.reason


def test_a_better_model_replaces_production_blue_green_with_alarm_rollback(settings: DeploySettings,
                                                                           updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)

    result = on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)

    assert (result.action, result.model) == ("updated", "atelier-second")
    assert updates == [{"EndpointName": settings.endpoint_name, "EndpointConfigName": "atelier-second",
                        "DeploymentConfig": deployment_config(settings)}]
    alarms = updates[0]["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    assert [a["AlarmName"] for a in alarms] == list(settings.rollback_alarms) and len(alarms) == 2


def test_a_duplicate_evaluation_event_deploys_once(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    finished = evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1)

    first, again = on_job_state(finished, settings), on_job_state(finished, settings)

    assert (first.action, again.action, len(updates)) == ("updated", "duplicate", 1)


def test_an_older_model_never_replaces_a_newer_one(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings, ended=ENDED + 5000)

    late = on_job_state(completed("atelier-older", ENDED), settings)

    assert (late.action, updates) == ("superseded", [])
    assert training_jobs() == [f"{JOB}-eval"]


def test_a_newer_model_that_passed_first_keeps_the_endpoint(settings: DeploySettings, updates: list) -> None:
    # GIVEN two candidates evaluating at once, the newer passing first
    deploy_first(settings)
    on_job_state(completed("atelier-b", ENDED + 1000), settings)
    on_job_state(completed("atelier-c", ENDED + 2000), settings)
    on_job_state(evaluation_finished(settings, "atelier-c", 0.09, baseline_loss=0.1), settings)

    # WHEN the older one passes afterwards
    result = on_job_state(evaluation_finished(settings, "atelier-b", 0.09, baseline_loss=0.1), settings)

    # THEN it does not replace the newer one
    assert result.action == "superseded"
    assert [u["EndpointConfigName"] for u in updates] == ["atelier-c"]


def test_production_changed_during_evaluation_means_evaluating_again(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-b", ENDED + 1000), settings)
    on_job_state(completed("atelier-c", ENDED + 2000), settings)
    on_job_state(evaluation_finished(settings, "atelier-b", 0.09, baseline_loss=0.1), settings)

    # c was scored against the first model, which no longer serves, on another evaluation set than b's record
    result = on_job_state(evaluation_finished(settings, "atelier-c", 0.08, baseline_loss=0.1, digest="f" * 64), settings)

    job = boto3.client("sagemaker").describe_training_job(TrainingJobName="atelier-c-ev1")
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert result.action == "evaluating"
    assert channels["baseline"] == f"{MODELS}/training/atelier-b/output/model.tar.gz"


def test_a_busy_endpoint_leaves_the_model_passed_until_it_is_in_service(settings: DeploySettings, updates: list,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    describe = aws.describe_endpoint
    monkeypatch.setattr(aws, "describe_endpoint", lambda name: {**describe(name), "EndpointStatus": "Updating"})

    waiting = on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)
    monkeypatch.setattr(aws, "describe_endpoint", describe)
    in_service = on_endpoint_state(settings.endpoint_name, settings)

    assert (waiting.action, model_record(settings, "atelier-second")["status"]) == ("waiting", "deployed")
    assert (in_service.action, in_service.model) == ("updated", "atelier-second")


# --- rollback and the endpoint's own events ---------------------------------------------------------

def test_rollback_restores_the_previous_model(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)

    result = rollback(settings.table, settings.endpoint_name)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert updates[-1] == {"EndpointName": settings.endpoint_name, "EndpointConfigName": JOB,
                           "DeploymentConfig": deployment_config(settings)}
    assert model_record(settings, "atelier-second")["status"] == "rolled-back"
    # and a duplicate event of the rolled-back model does not bring it back
    assert on_job_state(completed("atelier-second", ENDED + 1000), settings).action == "duplicate"


def test_rollback_without_an_earlier_model_is_a_clear_error(settings: DeploySettings) -> None:
    deploy_first(settings)

    with pytest.raises(BadMessage, match="no earlier model"):
        rollback(settings.table, settings.endpoint_name)


def test_a_rollback_request_rolls_back_and_answers_on_the_endpoint_record(settings: DeploySettings,
                                                                         updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)

    result = on_rollback_request({"request_id": "r1", "to": None, "reason": "bad colours"}, settings)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert updates[-1]["EndpointConfigName"] == JOB
    assert model_record(settings, "atelier-second")["reason"] == "bad colours"
    answer = aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["last_rollback"]
    assert answer == {"id": "r1", "action": "rolled-back", "model": JOB, "reason": f"atelier-second -> {JOB}"}


def test_a_rollback_request_that_cannot_succeed_is_refused_with_the_reason_and_changes_nothing(
        settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    before = len(updates)

    result = on_rollback_request({"request_id": "r2", "to": "atelier-never", "reason": ""}, settings)

    assert result.action == "refused" and "no earlier model" in result.reason
    assert len(updates) == before
    answer = aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["last_rollback"]
    assert (answer["id"], answer["action"]) == ("r2", "refused") and "no earlier model" in answer["reason"]


def test_an_automatic_rollback_is_recorded_when_the_endpoint_is_in_service(settings: DeploySettings,
                                                                           updates: list, monkeypatch) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)
    # GIVEN SageMaker rolled the update back on an alarm: the first config serves again
    describe = aws.describe_endpoint
    monkeypatch.setattr(aws, "describe_endpoint", lambda name: {**describe(name), "EndpointConfigName": JOB})

    result = on_endpoint_state(settings.endpoint_name, settings)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert model_record(settings, "atelier-second")["status"] == "rolled-back"
    assert aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["model"] == JOB


def test_an_endpoint_in_service_gets_autoscaling_on_invocations(settings: DeploySettings) -> None:
    deploy_first(settings)

    on_endpoint_state(settings.endpoint_name, settings)

    scaling = boto3.client("application-autoscaling")
    target = scaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    policy = scaling.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    assert [(t["ResourceId"], t["MinCapacity"], t["MaxCapacity"]) for t in target] == [
        (f"endpoint/{settings.endpoint_name}/variant/AllTraffic", settings.min_instances, settings.max_instances)]
    assert policy[0]["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"][
        "PredefinedMetricType"] == "SageMakerVariantInvocationsPerInstance"


def deploy_settings(**fields: Any) -> DeploySettings:
    """Settings with every variable the template requires (none of the optional ones), these fields changed."""
    return dataclasses.replace(DeploySettings.from_env(DEPLOY_REQUIRED), **fields)


def test_model_request_names_the_job_and_manifest() -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models")

    request = model_request(completed(), settings)

    assert request["ModelName"] == JOB
    assert {t["Key"]: t["Value"] for t in request["Tags"]} == {"atelier:training-job": JOB, "atelier:manifest": "ab" * 32}
    assert request["EnableNetworkIsolation"] is True


def test_the_models_container_has_the_operators_server_settings_beside_its_provenance() -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              serve_environment={"SERVE_COMPILE": "off", "SERVE_WARMUP_IMAGES": "1,4"})

    environment = model_request(completed(), settings)["PrimaryContainer"]["Environment"]

    assert environment == {"SERVE_COMPILE": "off", "SERVE_WARMUP_IMAGES": "1,4", "ATELIER_MODEL_ID": JOB,
                           "ATELIER_MANIFEST_DIGEST": "ab" * 32,
                           "ATELIER_ATTRIBUTION_URI": f"s3://models/training/{JOB}/output/attribution.json"}


def test_a_signing_model_names_its_secret_and_is_not_network_isolated() -> None:
    # AWS: a network-isolated container gets no credentials and no network, so a server that reads its
    # signing secret at start runs without isolation (docs/deploy.md); without a secret it keeps it
    secret = "arn:aws:secretsmanager:us-east-1:123456789012:secret:atelier/c2pa-signing-AbCdEf"
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              signing_secret_arn=secret)

    request = model_request(completed(), settings)

    assert request["PrimaryContainer"]["Environment"]["ATELIER_C2PA_SECRET"] == secret
    assert request["EnableNetworkIsolation"] is False


# AWS: CreateEndpointConfig "fails" when KmsKeyId is given for an instance type with local storage,
# as CreateTrainingJob does for VolumeKmsKeyId (docs/aws-differences.md).
KEY = "arn:aws:kms:us-east-1:123456789012:key/k"


@pytest.mark.parametrize("instance_type, keyed", [("ml.g5.xlarge", False), ("ml.g4dn.xlarge", False),
                                                  ("ml.p4d.24xlarge", False), ("ml.m5.large", True),
                                                  ("ml.g6e.2xlarge", False), ("ml.inf2.xlarge", True)])
def test_the_endpoint_config_names_the_key_only_where_aws_accepts_it(instance_type: str, keyed: bool) -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type=instance_type, models_bucket="models", kms_key=KEY)

    request = endpoint_config_request(completed(), settings)

    assert request.get("KmsKeyId") == (KEY if keyed else None)


def test_the_endpoint_config_gives_the_compiling_server_its_startup_time() -> None:
    """trainer/serve/generation.py compiles before /ping answers 200 (102 s on an H200): the variant says how long
    SageMaker waits for that (ContainerStartupHealthCheckTimeoutInSeconds), the template's parameter."""
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              startup_timeout_s=1500)

    [variant] = endpoint_config_request(completed(), settings)["ProductionVariants"]

    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1500


@pytest.mark.parametrize("instance_type, keyed", [("ml.g5.2xlarge", False), ("ml.m5.xlarge", True)])
def test_the_evaluation_job_encrypts_its_volume_only_where_aws_accepts_it(instance_type: str, keyed: bool) -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              kms_key=KEY, eval_instance_type=instance_type, eval_data_uri="s3://data/eval/")

    request = evaluation_job_request("m-eval", {"model": "m", "model_data": "s3://models/m.tar.gz"}, None, settings)

    assert request["ResourceConfig"].get("VolumeKmsKeyId") == (KEY if keyed else None)
    assert request["OutputDataConfig"]["KmsKeyId"] == KEY
