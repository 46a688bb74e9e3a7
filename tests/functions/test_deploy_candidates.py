"""core.deploy's candidates: which job's end or artefact is evaluated, and what a job is by its tags, never its name."""

from __future__ import annotations

import dataclasses

import boto3
import pytest

from contracts import job_tags, pipeline_table
from core import aws
from core.deploy import candidates
from core.deploy.candidates import on_artefact_published, on_job_state
from core.deploy.events import JobState, job_state_from_event
from core.errors import BadMessage
from core.deploy.settings import DeploySettings
from tests.unit.settings_helpers import DEPLOY_REQUIRED
from tests.functions.deploy_helpers import (  # noqa: F401  (settings: fixtures)
    JOB,
    MODELS,
    completed,
    evaluation_finished,
    model_record,
    settings,
    training_jobs,
)
from tests.support import load_event, sagemaker_job

pytestmark = pytest.mark.slow(seconds=12)


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
    # (tests/functions/test_training_jobs_end.py), on the same event
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
