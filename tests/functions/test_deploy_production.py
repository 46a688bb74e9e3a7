"""core.deploy's gate against production: worse, failed or older models held back, better ones rolled out."""

from __future__ import annotations

import json

import boto3
import pytest

from core import aws
from core.deploy.candidates import on_job_state
from core.deploy.requests import deployment_config
from core.deploy.rollout import on_endpoint_state
from core.deploy.settings import DeploySettings
from tests.unit.settings_helpers import DEPLOY_REQUIRED
from tests.functions.deploy_helpers import (  # noqa: F401  (settings, updates: fixtures)
    ENDED,
    JOB,
    MODELS,
    completed,
    deploy_first,
    evaluation_finished,
    model_record,
    settings,
    training_jobs,
    updates,
)


FLOW_LOSS, V_LOSS = "flow velocity at t = 0, 1/8, ..., 7/8", "v_prediction at timesteps 100,500,900"


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


@pytest.mark.parametrize("b_scored, c_scored", [
    ({}, {"digest": "f" * 64}),  # c on another evaluation set than b's record
    ({"measure": V_LOSS}, {"measure": V_LOSS, "resolution": 64}),  # b's loss at 32 px, c's at 64: other measures
], ids=["another set", "another measure"])
def test_production_changed_during_evaluation_means_evaluating_again(settings: DeploySettings, updates: list,
                                                                     b_scored: dict, c_scored: dict) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-b", ENDED + 1000), settings)
    on_job_state(completed("atelier-c", ENDED + 2000), settings)
    on_job_state(evaluation_finished(settings, "atelier-b", 0.09, baseline_loss=0.1, **b_scored), settings)

    # c was scored against the first model, which no longer serves, and b's record does not compare with c's scores
    result = on_job_state(evaluation_finished(settings, "atelier-c", 0.08, baseline_loss=0.1, **c_scored), settings)

    job = boto3.client("sagemaker").describe_training_job(TrainingJobName="atelier-c-ev1")
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert result.action == "evaluating"
    assert channels["baseline"] == f"{MODELS}/training/atelier-b/output/model.tar.gz"


def test_a_flow_model_against_a_unet_in_production_is_judged_by_clip_not_by_the_loss_ratio(settings: DeploySettings,
                                                                                          updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-dit", ENDED + 1000), settings)
    # the flow model's velocity loss is 3x the UNet's v loss: another quantity, not a worse model
    result = on_job_state(evaluation_finished(settings, "atelier-dit", 0.3, baseline_loss=0.1, measure=FLOW_LOSS,
                                              baseline_measure=V_LOSS, clip=26.0, baseline_clip=25.0), settings)
    assert result.action == "updated"
    gate = json.loads(model_record(settings, "atelier-dit")["gate"])
    assert (gate["decision"], gate["production"]["measure"]) == ("passed", f"{V_LOSS} at 32 px")
    assert "measure different things; CLIP score 26.00 against production's 25.00" in gate["reason"]


def test_a_flow_model_against_a_unet_without_clip_scores_is_held_back_saying_why(settings: DeploySettings,
                                                                                updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-dit", ENDED + 1000), settings)
    result = on_job_state(evaluation_finished(settings, "atelier-dit", 0.05, baseline_loss=0.1, measure=FLOW_LOSS,
                                              baseline_measure=V_LOSS), settings)
    assert result.action == "held-back"
    assert "measure different things, and there is no CLIP score" in result.reason
    assert updates == []


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
