"""A passing model reaches the endpoint: a blue/green update that rolls back on the endpoint's alarms,
rollback by hand, and the endpoint's own state changes (docs/deploy.md, "Rollout").

`ENDPOINT#<endpoint>` holds what is meant to serve and its order (the training end time): a claim
succeeds only for a newer model, so an older model never replaces a newer one.
"""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from core import aws, telemetry
from core.deploy.events import DeployResult, JobState
from core.deploy.records import now, production_model, serving_record, settle
from core.deploy.requests import VARIANT, deployment_config, endpoint_config_request, model_request
from core.errors import BadMessage
from core.deploy.settings import DeploySettings

logger = Logger(child=True)


class EndpointBusy(RuntimeError):
    """The endpoint is mid-update: an operator's rollback must wait until it is InService."""


def promote(name: str, settings: DeploySettings) -> DeployResult:
    """Create the model and config, claim the endpoint for this newer model, update it blue/green."""
    model = aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}
    job = JobState(name=model["job"], status="Completed", model_data_url=model["model_data"], failure_reason=None,
                   tags=tuple(sorted(json.loads(model.get("job_tags") or "{}").items())), ended_at=int(model["order"]))
    if not aws.sagemaker_exists("model", name):
        aws.sagemaker_call("create_model", model_request(job, settings))
    if not aws.sagemaker_exists("endpoint_config", name):
        aws.sagemaker_call("create_endpoint_config", endpoint_config_request(job, settings))
    endpoint = aws.describe_endpoint(settings.endpoint_name)
    if endpoint is not None and endpoint["EndpointStatus"] not in {"InService", "Failed"}:
        # stays `passed`: the endpoint's next InService event promotes the newest passed model
        return DeployResult("waiting", name, f"endpoint {settings.endpoint_name} is {endpoint['EndpointStatus']}")
    previous = production_model(settings)
    if not _claim_endpoint(name, int(model["order"]), previous, settings):
        settle(name, "superseded", "a newer model took the endpoint first", settings, expected="passed")
        return DeployResult("superseded", name)
    request = {"EndpointName": settings.endpoint_name, "EndpointConfigName": name,
               "DeploymentConfig": deployment_config(settings)}
    if endpoint is None:
        aws.sagemaker_call("create_endpoint", request)
        action = "created"
    elif endpoint.get("EndpointConfigName") == name:
        action = "unchanged"
    else:
        aws.sagemaker_call("update_endpoint", request)
        action = "updated"
    settle(name, "deployed", f"endpoint {settings.endpoint_name} {action}", settings, expected="passed",
           deployed_at=now())
    logger.info("endpoint deployment", extra={"model": name, "endpoint": settings.endpoint_name, "action": action})
    if action != "unchanged":
        telemetry.count(telemetry.DEPLOYMENTS)
    return DeployResult(action, name)


def _claim_endpoint(name: str, order: int, previous: dict[str, Any] | None, settings: DeploySettings) -> bool:
    """The endpoint record moves to this model only if it is newer than what serves (or it already did)."""
    history = list((previous or {}).get("history", []))
    if not history or history[-1] != name:
        history.append(name)
    return aws.update_item(
        settings.table, pipeline_table.endpoint_pk(settings.endpoint_name),
        "SET model = :m, #o = :o, history = :h, updated_at = :t, deployment_config = :d",
        {":m": name, ":o": order, ":h": history[-20:], ":t": now(), ":d": json.dumps(deployment_config(settings))},
        condition="attribute_not_exists(model) OR #o < :o OR model = :m", names={"#o": "order"})


def rollback_target(current: dict[str, Any] | None, endpoint_name: str, to: str | None) -> str:
    """The model a rollback serves: `to`, else the one before the current in the endpoint's history."""
    if current is None:
        raise BadMessage(f"endpoint {endpoint_name} has no deployed model to roll back")
    history = list(current["history"])
    earlier = [m for m in history[:-1] if m != current["model"]]
    target = to or (earlier[-1] if earlier else None)
    if target is None or target not in history or target == current["model"]:
        raise BadMessage(f"no earlier model to roll back to (history: {', '.join(history)})")
    return target


def check_endpoint_idle(endpoint_name: str) -> None:
    """A rollback updates the endpoint: it must exist and no update may be under way."""
    endpoint = aws.describe_endpoint(endpoint_name)
    if endpoint is None:
        raise BadMessage(f"endpoint {endpoint_name} does not exist")
    if endpoint["EndpointStatus"] not in {"InService", "Failed"}:
        raise EndpointBusy(f"endpoint {endpoint_name} is {endpoint['EndpointStatus']}; try again when InService")


def rollback(table: str, endpoint_name: str, to: str | None = None,
             reason: str = "rolled back by an operator") -> DeployResult:
    """Serve the previous deployed model again (or `to`), with the rollout settings it went out
    with; the current one is marked rolled-back so no duplicate event brings it back."""
    current = serving_record(table, endpoint_name)
    target = rollback_target(current, endpoint_name, to)
    check_endpoint_idle(endpoint_name)
    assert current is not None  # rollback_target refused otherwise
    request: dict[str, Any] = {"EndpointName": endpoint_name, "EndpointConfigName": target}
    if json.loads(current["deployment_config"]):
        request["DeploymentConfig"] = json.loads(current["deployment_config"])
    aws.sagemaker_call("update_endpoint", request)
    _mark_rolled_back(table, endpoint_name, current["model"], target, list(current["history"]), reason)
    return DeployResult("rolled-back", target, f"{current['model']} -> {target}")


def on_rollback_request(detail: dict[str, Any], settings: DeploySettings) -> DeployResult:
    """`atelier rollback` asked for a rollback: do it, or refuse it, and record the answer on the
    endpoint's record under the request's id, where the CLI reads it. A refusal is an answer, not a
    failure to retry: the endpoint's state may have changed since the CLI checked it."""
    request_id = str(detail.get("request_id", ""))
    if not request_id:
        raise BadMessage("a rollback request needs its request_id")
    try:
        result = rollback(settings.table, settings.endpoint_name, detail.get("to") or None,
                          str(detail.get("reason") or "rolled back by an operator"))
    except (BadMessage, EndpointBusy) as refused:
        result = DeployResult("refused", None, str(refused))
    answer = {"id": request_id, "action": result.action, "model": result.model or "", "reason": result.reason}
    # only on a record that exists: one that does not never had a model, so the CLI refused before asking
    aws.update_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name), "SET last_rollback = :a",
                    {":a": answer}, condition="attribute_exists(pk)")
    return result


def on_endpoint_state(endpoint_name: str, settings: DeploySettings) -> DeployResult:
    """An endpoint changed state: once InService, reconcile with SageMaker's truth (an automatic
    rollback leaves the previous config serving), make sure autoscaling is registered, and
    promote a model that passed the gate while the endpoint was busy."""
    if endpoint_name != settings.endpoint_name:
        return DeployResult("recorded", reason=f"endpoint {endpoint_name} is not ours")
    endpoint = aws.describe_endpoint(endpoint_name)
    if endpoint is None or endpoint["EndpointStatus"] != "InService":
        return DeployResult("recorded", reason=f"endpoint {(endpoint or {}).get('EndpointStatus', 'gone')}")
    ensure_autoscaling(settings)
    current = production_model(settings)
    serving = endpoint.get("EndpointConfigName")
    if current is not None and serving != current["model"] and serving in current["history"]:
        _mark_rolled_back(settings.table, endpoint_name, current["model"], serving, current["history"],
                          "rolled back automatically: an endpoint alarm fired during the rollout")
        logger.warning("automatic rollback", extra={"model": current["model"], "serving": serving})
        return DeployResult("rolled-back", serving, f"{current['model']} rolled back by SageMaker")
    waiting = newest_passed(settings)
    if waiting is not None:
        return promote(waiting, settings)
    return DeployResult("in-service", serving)


def newest_passed(settings: DeploySettings) -> str | None:
    """A model that passed the gate while the endpoint was busy, newest first."""
    passed = [m for m in aws.scan_prefix(settings.table, pipeline_table.MODEL_PREFIX)
              if m.get("status") == "passed" and m.get("endpoint") == settings.endpoint_name]
    return max(passed, key=lambda m: int(m["order"]))["model"] if passed else None


def _mark_rolled_back(table: str, endpoint: str, current: str, target: str, history: list[str], reason: str) -> None:
    telemetry.count(telemetry.ROLLBACKS)
    aws.update_item(table, pipeline_table.model_pk(current), "SET #s = :s, reason = :r",
                    {":s": "rolled-back", ":r": reason}, names={"#s": "status"})
    target_model = aws.get_item(table, pipeline_table.model_pk(target)) or {}
    # the history ends at the model serving again: what it replaced is not "previous" any more
    kept = history[:len(history) - history[::-1].index(target)] if target in history else [*history, target]
    serving = {":m": target, ":o": int(target_model.get("order", 0)), ":h": kept, ":t": now()}
    aws.update_item(table, pipeline_table.endpoint_pk(endpoint),
                    "SET model = :m, #o = :o, history = :h, updated_at = :t", serving, names={"#o": "order"})


def ensure_autoscaling(settings: DeploySettings) -> None:
    """Target tracking on invocations per instance; registering again is harmless."""
    resource = f"endpoint/{settings.endpoint_name}/variant/{VARIANT}"
    aws.register_scalable_target(resource, settings.min_instances, settings.max_instances)
    aws.put_target_tracking_policy(resource, f"{settings.endpoint_name}-invocations",
                                   float(settings.invocations_per_instance))
