"""Blue/green deployments of an endpoint: the new fleet's share of the traffic, its baking, rollback.

CreateEndpoint and UpdateEndpoint each start a Deployment in a background thread. The new (green)
container starts beside the old (blue) one, which keeps serving; once green answers /ping, traffic
shifts per the DeploymentConfig (all at once, canary, linear), each step followed by a baking period
during which the AutoRollbackConfiguration alarms are polled in CloudWatch. An alarm in ALARM sends
all traffic back to blue and retires green (automatic rollback); a green that never answers /ping is
retired the same way. After the final baking period blue is retired. A create has no blue: its
container goes live once it answers /ping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.deployment_config import alarm_names, execution_timeout, routing_type, traffic_plan
from atelier.local.sagemaker.documents import utc_now
from atelier.local.sagemaker.hosting_reports import HostingReports
from atelier.local.sagemaker.hosting_resources import Endpoint, EndpointConfig, Model, variant_summary
from atelier.local.sagemaker.serving import DeployFailure, Server, Supervisor
from atelier.local.sagemaker.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class Deployment:
    """A CreateEndpoint or UpdateEndpoint in flight: the new fleet, its share of the invocations and its
    stage, shown as DescribeEndpoint's PendingDeploymentSummary."""

    config: EndpointConfig
    deployment_config: dict[str, Any] | None
    capacity: int  # the instance count canary and linear sizes are measured on
    start_time: datetime = field(default_factory=utc_now)
    server: Server | None = None
    share: float = 0.0
    stage: str = "Creating"
    stage_message: str = "Launching 1 instance(s)."
    stage_time: datetime = field(default_factory=utc_now)
    _credit: float = 0.0

    def takes_next(self) -> bool:
        """Whether the next invocation goes to the new fleet: exactly `share` of them, evenly spread
        (deterministic, so a test can count them)."""
        if self.server is None or self.share <= 0:
            return False
        self._credit += self.share
        if self._credit >= 1 - 1e-9:
            self._credit -= 1
            return True
        return False

    def summary(self) -> dict[str, Any]:
        variant = self.config.variant
        weight = float(variant.get("InitialVariantWeight", 1.0))
        pending: dict[str, Any] = {
            "VariantName": variant["VariantName"], "CurrentWeight": weight, "DesiredWeight": weight,
            "CurrentInstanceCount": 1 if self.server else 0, "DesiredInstanceCount": 1,
            "VariantStatus": [{"Status": self.stage, "StatusMessage": self.stage_message,
                               "StartTime": self.stage_time}]}
        if variant.get("InstanceType"):
            pending["InstanceType"] = variant["InstanceType"]
        if self.server:
            pending["DeployedImages"] = variant_summary(self.server)["DeployedImages"]
        return {"EndpointConfigName": self.config.name, "StartTime": self.start_time, "ProductionVariants": [pending]}


class Rollout:
    """Runs each endpoint's deployments: the new container launched, traffic shifted and baked, then
    the old container retired, or the new one on a rollback.

    Endpoint fields change under the hosting lock, the one InvokeEndpoint routes under, so an
    invocation sees a deployment's share and its switch-over whole.
    """

    def __init__(self, settings: Settings, clients: AwsClients, lock: threading.RLock, supervisor: Supervisor,
                 reports: HostingReports, find_model: Callable[[str], Model | None]):
        self._settings = settings
        self._clients = clients
        self._lock = lock
        self._supervisor = supervisor
        self._reports = reports
        self._find_model = find_model

    def start(self, endpoint: Endpoint, deployment: Deployment) -> None:
        """Run the deployment in the background: the endpoint's deployment is `deployment` already."""
        self._supervisor.in_background(self._deploy, endpoint, deployment,
                                       name=f"deploy-{endpoint.name}-{deployment.config.name}")

    def _deploy(self, endpoint: Endpoint, deployment: Deployment) -> None:
        try:
            server = self._launch(endpoint, deployment.config)
        except DeployFailure as failure:
            self._deployment_failed(endpoint, deployment, str(failure))
        except Exception as error:  # the runner broke: report it on the endpoint
            logger.exception("deploying %s to %s failed", deployment.config.name, endpoint.name)
            self._deployment_failed(endpoint, deployment, f"InternalFailure: local runner: {error}")
        else:
            self._roll_out(endpoint, deployment, server)

    def _launch(self, endpoint: Endpoint, config: EndpointConfig) -> Server:
        """The config's one variant started on its model, answering /ping."""
        if len(config.variants) != 1:
            raise DeployFailure("The local SageMaker supports endpoint configs with one ProductionVariant")
        variant = config.variants[0]
        model = self._find_model(variant["ModelName"])
        if model is None:
            raise DeployFailure(f'Could not find model "{self._settings.arn("model", variant["ModelName"])}".')
        return self._supervisor.launch(endpoint.name, config.name, variant, model, endpoint.deleted)

    def _roll_out(self, endpoint: Endpoint, deployment: Deployment, server: Server) -> None:
        """Shift traffic to the healthy new container step by step, baking after each step while the
        rollback alarms are polled; then retire the old container, or on an alarm roll back."""
        with self._lock:
            if endpoint.deployment is not deployment:  # deleted while deploying: nobody will route to it
                retired: Server | None = server
            else:
                deployment.server, retired = server, None
        if retired:
            return self._supervisor.retire(server)
        if endpoint.server is None:  # a create: nothing to shift traffic from
            return self._complete(endpoint, deployment)
        config = deployment.deployment_config
        alarms = alarm_names(config)
        timeout = execution_timeout(config)
        elapsed = (utc_now() - deployment.start_time).total_seconds()
        deadline = time.monotonic() - elapsed + timeout if timeout else None
        partial = "canary capacity" if routing_type(config) == "CANARY" else "partial capacity"
        for step in traffic_plan(config, deployment.capacity):
            capacity = "full capacity" if step.share >= 1 else f"{partial} of {step.share:.0%} of invocations"
            self._set_stage(endpoint, deployment, "ActivatingTraffic", f"Activating traffic on {capacity}.",
                            share=step.share)
            if step.bake_seconds:
                self._set_stage(endpoint, deployment, "Baking", f"Baking for {step.bake_seconds} seconds "
                                f"({step.bake_member}) with traffic enabled on {capacity}.")
            reason = self._bake(endpoint, step.bake_seconds, alarms, deadline)
            if endpoint.deleted.is_set():
                return self._supervisor.retire(server)
            if reason:
                return self._roll_back(endpoint, deployment, reason)
        self._complete(endpoint, deployment)

    def _bake(self, endpoint: Endpoint, seconds: float, alarms: list[str], deadline: float | None) -> str | None:
        """Wait out a baking period polling the alarms (once at least); why to roll back, or None."""
        end = time.monotonic() + seconds
        while True:
            firing = self._alarms_firing(alarms)
            if firing:
                return (f"Rolled back: CloudWatch alarm(s) {', '.join(firing)} in the AutoRollbackConfiguration "
                        "went into ALARM during the deployment.")
            if deadline is not None and time.monotonic() >= deadline:
                return "Rolled back: the deployment exceeded MaximumExecutionTimeoutInSeconds."
            remaining = end - time.monotonic()
            if remaining <= 0 or endpoint.deleted.wait(min(remaining, self._settings.alarm_poll_seconds)):
                return None

    def _alarms_firing(self, names: list[str]) -> list[str]:
        """The named alarms now in ALARM (DescribeAlarms on CloudWatch); none when CloudWatch cannot answer."""
        if not names:
            return []
        try:
            states = self._alarm_states(names)
        except Exception:  # an unreachable CloudWatch does not roll a deployment back
            logger.warning("could not read the rollback alarms %s", names, exc_info=True)
            return []
        return sorted(name for name, state in states.items() if state == "ALARM")

    def _alarm_states(self, names: list[str]) -> dict[str, str]:
        answer = self._clients.get("cloudwatch").describe_alarms(AlarmNames=names)
        alarms = [*answer.get("MetricAlarms", []), *answer.get("CompositeAlarms", [])]
        return {alarm["AlarmName"]: alarm["StateValue"] for alarm in alarms}

    def _set_stage(self, endpoint: Endpoint, deployment: Deployment, stage: str, message: str,
                   share: float | None = None) -> None:
        with self._lock:
            if endpoint.deployment is not deployment:
                return
            deployment.stage, deployment.stage_message, deployment.stage_time = stage, message, utc_now()
            if share is not None:
                deployment.share = share
            self._reports.deployment_changed(endpoint)

    def _complete(self, endpoint: Endpoint, deployment: Deployment) -> None:
        """All traffic on the new container, which becomes the live one; the old one is retired."""
        with self._lock:
            if endpoint.deployment is not deployment:
                retired = deployment.server
            else:
                retired, endpoint.server = endpoint.server, deployment.server
                endpoint.config_name, endpoint.status, endpoint.deployment = deployment.config.name, "InService", None
                endpoint.failure_reason, endpoint.last_modified = None, utc_now()
                self._reports.endpoint_changed(endpoint)
        if retired:
            self._supervisor.retire(retired)

    def _roll_back(self, endpoint: Endpoint, deployment: Deployment, reason: str) -> None:
        """All traffic back to the old container at once, the new one retired, the endpoint InService on
        its previous config with the reason as FailureReason."""
        with self._lock:
            if endpoint.deployment is deployment:
                deployment.share = 0.0
                self._set_stage(endpoint, deployment, "Deleting", f"Terminating 1 instance(s). {reason}")
                endpoint.status, endpoint.deployment = "InService", None
                endpoint.failure_reason, endpoint.last_modified = reason, utc_now()
                self._reports.endpoint_changed(endpoint)
        logger.warning("endpoint %s: %s", endpoint.name, reason)
        if deployment.server:
            self._supervisor.retire(deployment.server)

    def _deployment_failed(self, endpoint: Endpoint, deployment: Deployment, reason: str) -> None:
        """A failed create leaves the endpoint Failed; a failed update keeps the old container serving."""
        with self._lock:
            if endpoint.deployment is not deployment:
                return
            endpoint.status = "InService" if endpoint.server else "Failed"
            endpoint.deployment = None
            endpoint.failure_reason, endpoint.last_modified = reason[:1024], utc_now()
            self._reports.endpoint_changed(endpoint)
        logger.warning("endpoint %s: %s", endpoint.name, reason)
