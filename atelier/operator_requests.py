"""What an operator asks of the pipeline's functions from the CLI: an evaluation again (`atelier evaluate`), a
lineage resumed (`atelier lineage resume`), a rollback (`atelier rollback`). Each is an EventBridge event the
owning function handles under its own role; the operator's machine reads the table to check the request and
to follow its answer, and writes no pipeline state.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from atelier.client import PipelineError
from contracts import pipeline_table
from core import aws


def evaluate(outputs: dict[str, str], model: str) -> dict[str, Any]:
    """Ask DeployFunction to evaluate an eval-failed model again (`atelier evaluate`); it runs
    under the function's role, like every other evaluation."""
    from core.deploy.events import EVALUATE_REQUEST, EVALUATE_SOURCE
    record = aws.get_item(outputs["PipelineTableName"], pipeline_table.model_pk(model))
    if record is None:
        raise PipelineError(f"no model {model!r}; `atelier models` lists them")
    if record.get("status") != "eval-failed":
        raise PipelineError(f"model {model} is {record.get('status')}: only an eval-failed model is evaluated again")
    aws.put_event("default", EVALUATE_SOURCE, EVALUATE_REQUEST, json.dumps({"model": model}))
    return {"model": model, "requested": True, "previous_reason": record.get("reason", ""),
            "attempt": int(record.get("eval_attempt", 0))}  # the request's evaluation is a later attempt


def resume_lineage(outputs: dict[str, str], name: str) -> dict[str, Any]:
    """Ask StartTrainingFunction to lift a lineage's failure brake and start what is due
    (`atelier lineage resume NAME`); the failures stay on record. What it was is read here."""
    from core.start_training import failure_brake
    from core.start_training.starter import RESUME_REQUEST, RESUME_SOURCE
    table = outputs["PipelineTableName"]
    record = aws.get_item(table, pipeline_table.lineage_pk(name))
    if record is None:
        lineages = aws.scan_prefix(table, pipeline_table.LINEAGE_PREFIX)
        known = sorted(pipeline_table.lineage_name(i["pk"]) for i in lineages)
        raise PipelineError(f"no lineage {name!r}; lineages: {', '.join(known) or 'none yet'}")
    brake = failure_brake.Brake.from_item(record)
    aws.put_event("default", RESUME_SOURCE, RESUME_REQUEST, json.dumps({"lineage": name}))
    return {"lineage": name, "was_halted": brake.halted, "was_backing_off_s": max(0, int(brake.not_before - time.time())),
            "model_failures": brake.model_failures, "last_failure": brake.failures[-1] if brake.failures else None}


def rollback(outputs: dict[str, str], to: str | None, reason: str, timeout_s: float = 120.0,
             on_wait: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Ask DeployFunction to serve the previous model again (`atelier rollback`), as `evaluate` asks it
    to evaluate: the function updates the endpoint under its own role and answers on the endpoint's
    record. Checked here first (read-only) so a request that cannot succeed is refused at once."""
    from core.deploy.events import EVALUATE_SOURCE, ROLLBACK_REQUEST
    from core.deploy.records import serving_record
    from core.deploy.rollout import EndpointBusy, check_endpoint_idle, rollback_target
    from core.errors import BadMessage
    table, endpoint = outputs["PipelineTableName"], outputs["EndpointName"]
    try:
        rollback_target(serving_record(table, endpoint), endpoint, to)
        check_endpoint_idle(endpoint)
    except (BadMessage, EndpointBusy) as exc:
        raise PipelineError(str(exc)) from exc
    request_id = uuid.uuid4().hex
    aws.put_event("default", EVALUATE_SOURCE, ROLLBACK_REQUEST,
                  json.dumps({"request_id": request_id, "to": to, "reason": reason}))
    answer = _rollback_answer(table, endpoint, request_id, timeout_s, on_wait)
    if answer["action"] != "rolled-back":
        raise PipelineError(f"DeployFunction refused the rollback: {answer['reason']}")
    return {"action": answer["action"], "model": answer["model"], "change": answer["reason"]}


def _rollback_answer(table: str, endpoint: str, request_id: str, timeout_s: float,
                     on_wait: Callable[[float], None] | None) -> dict[str, Any]:
    started = time.monotonic()
    while (waited := time.monotonic() - started) < timeout_s:
        record = aws.get_item(table, pipeline_table.endpoint_pk(endpoint)) or {}
        answer = record.get("last_rollback") or {}
        if answer.get("id") == request_id:
            return answer
        if on_wait:
            on_wait(waited)
        time.sleep(1.0)
    raise PipelineError(f"no answer to the rollback request {request_id} within {timeout_s:.0f} s: DeployFunction's "
                        "log and DeployDLQ say why; `atelier status` shows the endpoint")
