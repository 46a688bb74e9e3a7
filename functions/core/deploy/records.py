"""The deploy stage's records in the pipeline table: a model's state machine (`MODEL#`), what an
endpoint serves (`ENDPOINT#`), and the one field it writes on a job's record (`JOB#`).

A model moves evaluating -> passed | held-back | eval-failed | superseded -> deployed -> rolled-back
(docs/deploy.md), each step one conditional write from the state it expects, so duplicate events
act once.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from contracts import pipeline_table
from core import aws
from core.deploy.events import JobState
from core.deploy.settings import DeploySettings


def record_job_artefact(job: JobState, settings: DeploySettings) -> None:
    """The artefact SageMaker reported, on the job's record: the start-training stage owns its status
    (docs/training-jobs.md). Only jobs the pipeline started have a record: never create one."""
    aws.update_item(settings.table, pipeline_table.job_pk(job.name), "SET model_data = :m",
                    {":m": job.model_data_url or ""}, condition="attribute_exists(pk)")


def settle(name: str, status: str, reason: str, settings: DeploySettings, expected: str = "evaluating",
           **extra: Any) -> bool:
    """One transition of a model's record; False when another invocation made it first."""
    sets = ", ".join(f"{k} = :{k}" for k in extra)
    values = {":s": status, ":r": reason, ":expected": expected, **{f":{k}": v for k, v in extra.items()}}
    return aws.update_item(settings.table, pipeline_table.model_pk(name),
                           "SET #s = :s, reason = :r" + (f", {sets}" if sets else ""), values,
                           condition="#s = :expected", names={"#s": "status"})


def production_model(settings: DeploySettings) -> dict[str, Any] | None:
    return serving_record(settings.table, settings.endpoint_name)


def serving_record(table: str, endpoint: str) -> dict[str, Any] | None:
    """The model the endpoint record says serves, with its order, scores and rollout history."""
    record = aws.get_item(table, pipeline_table.endpoint_pk(endpoint))
    if not record or not record.get("model"):
        return None
    model = aws.get_item(table, pipeline_table.model_pk(record["model"])) or {}
    return {**model, "model": record["model"], "order": int(record["order"]), "history": record.get("history", []),
            "deployment_config": record.get("deployment_config", "{}")}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
