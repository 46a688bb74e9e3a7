"""A candidate's evaluation job, and its end -> the gate's decision: on the model's record, and as
`evaluation.json` beside the model artefact (what `atelier report --job` shows); a passing model
goes on to the rollout. The decision itself is core.deploy.gate's."""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table, s3_layout
from core import aws, telemetry
from core.deploy.events import CANDIDATE_TAG, EVAL_SUFFIX, DeployResult, JobState
from core.deploy.gate import Evaluation, Scores, Thresholds, decide, parse_evaluation
from core.deploy.records import production_model, settle
from core.deploy.requests import evaluation_job_name, evaluation_job_request
from core.deploy.rollout import promote
from core.deploy.settings import DeploySettings

logger = Logger(child=True)


def start_evaluation(model: dict[str, Any], production: dict[str, Any] | None, settings: DeploySettings,
                     attempt: int = 0) -> DeployResult:
    name = evaluation_job_name(model["model"], attempt)
    request = evaluation_job_request(name, model, production, settings)
    aws.create_training_job(request)  # False: a redelivered event found it started already
    aws.update_item(settings.table, pipeline_table.model_pk(model["model"]), "SET eval_job = :j, baseline = :b",
                    {":j": name, ":b": production["model"] if production else ""})
    logger.info("evaluation started", extra={"model": model["model"], "eval_job": name,
                                             "baseline": production["model"] if production else None})
    return DeployResult("evaluating", model["model"])


def on_evaluation_finished(job: JobState, settings: DeploySettings) -> DeployResult:
    name = job.tag_map.get(CANDIDATE_TAG) or job.name.removesuffix(EVAL_SUFFIX)
    model = aws.get_item(settings.table, pipeline_table.model_pk(name))
    if model is None:
        return DeployResult("recorded", reason=f"evaluation {job.name} of an unknown model")
    if job.status in {"InProgress", "Stopping"}:
        return DeployResult("recorded", name, job.status)
    if model.get("status") != "evaluating" or model.get("eval_job") != job.name:
        return DeployResult("duplicate", name, f"already {model.get('status')}")
    if job.status != "Completed" or not job.model_data_url:
        settle(name, "eval-failed", f"evaluation {job.name} {job.status}: {job.failure_reason or ''}".strip(), settings)
        telemetry.count(telemetry.MODELS_HELD_BACK)
        return DeployResult("eval-failed", name)
    evaluation = parse_evaluation(aws.read_tar_member(job.model_data_url, s3_layout.EVALUATION_FILE))
    return gate(model, evaluation, settings)


def gate(model: dict[str, Any], evaluation: Evaluation, settings: DeploySettings) -> DeployResult:
    """Compare with production on the same evaluation set; promote, hold back, or re-evaluate."""
    name = model["model"]
    production = production_model(settings)
    baseline = _production_scores(production, model, evaluation)
    if production and baseline is None:  # production changed, or was scored on another set: score again
        attempt = int(model.get("eval_attempt", 0)) + 1
        aws.update_item(settings.table, pipeline_table.model_pk(name), "SET eval_attempt = :a", {":a": attempt})
        return start_evaluation({**model, "eval_attempt": attempt}, production, settings, attempt)
    decision = decide(evaluation.candidate, baseline, thresholds(settings))
    status = "passed" if decision.passed else "held-back"
    gate_record = {"decision": status, "reason": decision.reason, "scores": evaluation.candidate.to_item(),
                   "production": baseline.to_item() if baseline else None,
                   "production_model": production["model"] if production else "",
                   "thresholds": {"max_loss": settings.gate_max_loss, "max_loss_ratio": settings.gate_max_loss_ratio,
                                  "min_clip_delta": settings.gate_min_clip_delta}}
    if not settle(name, status, decision.reason, settings, gate=json.dumps(gate_record),
                  scores=evaluation.candidate.to_item()):
        return DeployResult("duplicate", name)
    logger.info("evaluation gate", extra={"model": name, "decision": status, "reason": decision.reason})
    publish_decision(model, gate_record)
    telemetry.count(telemetry.MODELS_EVALUATED)
    if not decision.passed:
        telemetry.count(telemetry.MODELS_HELD_BACK)
        return DeployResult("held-back", name, decision.reason)
    return promote(name, settings)


def thresholds(settings: DeploySettings) -> Thresholds:
    return Thresholds(settings.gate_max_loss, settings.gate_max_loss_ratio, settings.gate_min_clip_delta)


def publish_decision(model: dict[str, Any], gate_record: dict[str, Any]) -> None:
    """`evaluation.json` beside the model artefact: the training report shows it (`atelier report --job`
    renders the page from it, the job's output data and lineage.json)."""
    bucket, _, key = str(model["model_data"]).removeprefix("s3://").partition("/")
    document = {"gate": gate_record, "model": model["model"], "evaluation_job": model.get("eval_job", "")}
    aws.write_object(bucket, f"{key.rsplit('/', 1)[0]}/{s3_layout.EVALUATION_FILE}",
                     json.dumps(document, indent=1).encode(), "application/json")


def _production_scores(production: dict[str, Any] | None, model: dict[str, Any],
                       evaluation: Evaluation) -> Scores | None:
    """Production's scores from this very evaluation when it scored production, else from
    production's own record when that was on the same evaluation set and its loss measures what the
    candidate's does (else production is scored again beside the candidate)."""
    if production is None:
        return None
    if evaluation.baseline and model.get("baseline") == production["model"]:
        return evaluation.baseline
    stored = production.get("scores")
    if stored:
        scores = Scores.from_item(stored)
        if (scores.eval_set, scores.measure) == (evaluation.candidate.eval_set, evaluation.candidate.measure):
            return scores
    return None
