"""A finished training job becomes a candidate, and its evaluation starts (docs/deploy.md).

Candidates come from the Completed event of a run plan's final job or from the artefact's S3 object-created
event ("checkpoint published"); both name the same model (the job's name, which carries the
manifest hash), so the first creates `MODEL#<name>` and the second finds it. Failed and Stopped
jobs are recorded, never served; an evaluation job's end goes to core.deploy.evaluations.

What a job is comes from its tags: the event's, or SageMaker's ListTags when the event's do not say
(an event may carry none). A job whose tags cannot be read, or do not say, is refused: logged, and
nothing more (never a candidate by default).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from core import aws, telemetry
from core.deploy.evaluations import on_evaluation_finished, start_evaluation
from core.deploy.events import MANIFEST_TAG, DeployResult, JobState, job_from_artefact_key, job_state_from_event
from core.deploy.records import now, production_model, record_job_artefact, settle
from core.deploy.requests import model_name_for
from core.errors import BadMessage
from core.deploy.settings import DeploySettings

logger = Logger(child=True)


def on_job_state(job: JobState, settings: DeploySettings) -> DeployResult:
    """A training job changed state: evaluation jobs feed the gate; Completed final run-plan jobs
    become candidates; everything else is recorded and left alone."""
    job, unknown = identify(job)
    if unknown:
        return refuse(job, unknown)
    if job.is_evaluation:
        return on_evaluation_finished(job, settings)
    record_job_artefact(job, settings)
    if job.status != "Completed" or not job.final_planned_job:
        logger.info("training job state recorded", extra={"job": job.name, "status": job.status})
        return DeployResult("recorded", reason=f"{job.status}, final run-plan job {job.final_planned_job}")
    if not job.model_data_url:
        raise BadMessage(f"Completed job {job.name} has no ModelArtifacts")
    return consider_candidate(job, settings)


def on_artefact_published(bucket: str, key: str, settings: DeploySettings) -> DeployResult:
    """The model artefact landed in S3: a candidate once its job is Completed (a Stopped job's
    artefact lands too, and must never be served)."""
    job = describe_job(job_from_artefact_key(key))
    if job is None:
        return DeployResult("recorded", reason=f"no training job for s3://{bucket}/{key}")
    job, unknown = identify(job)
    if unknown:
        return refuse(job, unknown)
    if job.status != "Completed" or not job.final_planned_job or job.is_evaluation:
        return DeployResult("recorded", job.name, f"artefact of a {job.status} job (final run-plan job {job.final_planned_job})")
    return consider_candidate(job, settings)


def describe_job(name: str) -> JobState | None:
    """The job as DescribeTrainingJob gives it: without tags (`identify` lists them)."""
    described = aws.describe_training_job(name)
    return None if described is None else job_state_from_event(described)


def identify(job: JobState) -> tuple[JobState, str]:
    """The job with tags that say what it is, listed by SageMaker when its event's do not; or why not."""
    if not job.unidentified:
        return job, ""
    tags = aws.training_job_tags(job.name)
    if tags is None:
        return job, f"the tags of training job {job.name} cannot be read from SageMaker"
    job = dataclasses.replace(job, tags=tuple(sorted(tags.items())))
    return job, job.unidentified and f"the tags of training job {job.name} do not say what it is: {job.unidentified}"


def refuse(job: JobState, reason: str) -> DeployResult:
    """Fail closed: a job the deploy stage cannot tell is never a candidate, nor an evaluation's end."""
    logger.error("training job refused", extra={"job": job.name, "status": job.status, "reason": reason})
    return DeployResult("refused", job.name, reason)


def consider_candidate(job: JobState, settings: DeploySettings) -> DeployResult:
    """Record the candidate once, then start its evaluation unless production is newer."""
    name = model_name_for(job)
    aws.put_item_if_absent(settings.table, {
        "pk": pipeline_table.model_pk(name), "kind": "model", "model": name, "status": "evaluating", "job": job.name,
        "manifest": job.tag_map.get(MANIFEST_TAG, ""), "model_data": job.model_data_url or "",
        "order": job.ended_at, "created_at": now(), "endpoint": settings.endpoint_name,
        "job_tags": json.dumps(job.tag_map, sort_keys=True)})
    model = aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}
    if model.get("status") != "evaluating" or model.get("eval_job"):
        return DeployResult("duplicate", name, f"already {model.get('status')}")
    return evaluate_unless_superseded(model, settings)


def evaluate_unless_superseded(model: dict[str, Any], settings: DeploySettings, attempt: int = 0) -> DeployResult:
    """Start the model's evaluation, unless production is newer or there is no held-out set."""
    name = model["model"]
    production = production_model(settings)
    if production and int(production["order"]) >= int(model["order"]):
        settle(name, "superseded", f"older than production model {production['model']}", settings)
        return DeployResult("superseded", name)
    if not has_eval_shards(settings.eval_data_uri):
        settle(name, "eval-failed", f"no held-out shards (*.tar) under {settings.eval_data_uri}: add them "
               f"with `atelier evalset add`, then `atelier evaluate {name}`", settings)
        telemetry.count(telemetry.MODELS_HELD_BACK)
        return DeployResult("eval-failed", name, "no evaluation set")
    return start_evaluation(model, production, settings, attempt)


def reevaluate(name: str, settings: DeploySettings) -> DeployResult:
    """`atelier evaluate MODEL`: an eval-failed model (no held-out set then, or a failed evaluation
    job) is evaluated again, under a new evaluation job name; any other state is left alone."""
    model = aws.get_item(settings.table, pipeline_table.model_pk(name))
    if model is None:
        raise BadMessage(f"no model {name!r} (`atelier models` lists them)")
    attempt = int(model.get("eval_attempt", 0)) + 1
    if not aws.update_item(settings.table, pipeline_table.model_pk(name),
                           "SET #s = :evaluating, eval_attempt = :a, reason = :r REMOVE eval_job",
                           {":evaluating": "evaluating", ":a": attempt, ":r": "evaluated again on request",
                            ":failed": "eval-failed"}, condition="#s = :failed", names={"#s": "status"}):
        return DeployResult("duplicate", name, f"{model.get('status')}, not eval-failed: left as it is")
    logger.info("evaluation requested again", extra={"model": name, "attempt": attempt})
    model = {k: v for k, v in model.items() if k != "eval_job"}
    return evaluate_unless_superseded({**model, "status": "evaluating", "eval_attempt": attempt}, settings, attempt)


def has_eval_shards(uri: str) -> bool:
    """Whether the held-out set has a shard: checked before an evaluation job (minutes of an
    instance) is started only to fail on an empty channel."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return any(item["Key"].endswith(".tar") for item in aws.list_objects(bucket, prefix))
