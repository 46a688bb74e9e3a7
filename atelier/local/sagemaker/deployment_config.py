"""DeploymentConfig for CreateEndpoint / UpdateEndpoint: the rules its API reference states in prose,
and the traffic plan it implies.

Pure: no clients, no threads. `check_deployment_config` refuses, as SageMaker does, a config that
breaks the documented rules (canary <= 50% of the fleet, linear steps 10-50%); its shape is checked
against botocore's model before (shape_checks.py). `traffic_plan` turns a checked config into the
steps the endpoint runs: each step a share of the invocations sent to the new (green) fleet and a
baking period during which the alarms are watched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from atelier.local.sagemaker.validation import not_emulated, validation_error


@dataclass(frozen=True)
class Step:
    """Send `share` of the invocations to the green fleet, then bake for `bake_seconds`."""

    share: float
    bake_seconds: int
    bake_member: str  # the member the baking period comes from, for status messages


def check_deployment_config(config: dict[str, Any] | None, instance_count: int) -> dict[str, Any] | None:
    """The config, or the ValidationException SageMaker gives; instance_count is the new variant's.
    Its shape (members, ranges, enums) is botocore's model, checked by shape_checks before this."""
    if config is not None and "RollingUpdatePolicy" in config:
        raise not_emulated("RollingUpdatePolicy (BlueGreenUpdatePolicy only)")
    policy = (config or {}).get("BlueGreenUpdatePolicy")
    if policy is None:
        return config
    # API reference, TrafficRoutingConfig: CANARY shifts CanarySize first, LINEAR LinearStepSize a step;
    # "CanarySize ... must be less than or equal to 50%", "LinearStepSize ... must be 10-50%" of the
    # variant's total instance count
    routing = policy["TrafficRoutingConfiguration"]
    kind = routing["Type"]
    if kind == "CANARY" and _share(routing, "CanarySize", instance_count) > 0.5:
        raise validation_error(f"CanarySize {_size_text(routing['CanarySize'])} is more than 50% of the "
                               f"variant's total instance count ({instance_count}).")
    if kind == "LINEAR" and not 0.1 <= _share(routing, "LinearStepSize", instance_count) <= 0.5:
        raise validation_error(f"LinearStepSize {_size_text(routing['LinearStepSize'])} must be 10-50% of the "
                               f"variant's total instance count ({instance_count}).")
    # API reference, BlueGreenUpdatePolicy.MaximumExecutionTimeoutInSeconds: "should be larger than the
    # total waiting time specified in TerminationWaitInSeconds and WaitIntervalInSeconds"
    timeout = policy.get("MaximumExecutionTimeoutInSeconds")
    waits = policy.get("TerminationWaitInSeconds", 0) + routing["WaitIntervalInSeconds"]
    if timeout is not None and timeout <= waits:
        raise validation_error(f"MaximumExecutionTimeoutInSeconds ({timeout}) must be larger than the total waiting "
                               f"time in TerminationWaitInSeconds and WaitIntervalInSeconds ({waits}).")
    return config


def _share(routing: dict[str, Any], member: str, instance_count: int) -> float:
    size = routing.get(member)
    if size is None:
        raise validation_error(f"{member} must be specified when the TrafficRoutingConfiguration Type is "
                               f"{routing['Type']}.")
    if size["Type"] == "CAPACITY_PERCENT":
        return size["Value"] / 100
    return size["Value"] / max(instance_count, 1)


def _size_text(size: dict[str, Any]) -> str:
    return f"{size['Value']}%" if size["Type"] == "CAPACITY_PERCENT" else f"{size['Value']} instance(s)"


def alarm_names(config: dict[str, Any] | None) -> list[str]:
    alarms = ((config or {}).get("AutoRollbackConfiguration") or {}).get("Alarms", [])
    return [alarm["AlarmName"] for alarm in alarms if alarm.get("AlarmName")]


def traffic_plan(config: dict[str, Any] | None, instance_count: int) -> list[Step]:
    """The steps of a checked config; no config (or no BlueGreenUpdatePolicy) is all at once, no baking."""
    policy = (config or {}).get("BlueGreenUpdatePolicy")
    if policy is None:
        return [Step(1.0, 0, "TerminationWaitInSeconds")]
    routing = policy["TrafficRoutingConfiguration"]
    wait = routing["WaitIntervalInSeconds"]
    final = Step(1.0, policy.get("TerminationWaitInSeconds", 0), "TerminationWaitInSeconds")
    if routing["Type"] == "CANARY":
        return [Step(_share(routing, "CanarySize", instance_count), wait, "WaitIntervalInSeconds"), final]
    if routing["Type"] == "LINEAR":
        step = _share(routing, "LinearStepSize", instance_count)
        count = math.ceil(round(1 / step, 9))
        return [Step(k * step, wait, "WaitIntervalInSeconds") for k in range(1, count)] + [final]
    return [final]


def execution_timeout(config: dict[str, Any] | None) -> int | None:
    return ((config or {}).get("BlueGreenUpdatePolicy") or {}).get("MaximumExecutionTimeoutInSeconds")


def routing_type(config: dict[str, Any] | None) -> str:
    policy = (config or {}).get("BlueGreenUpdatePolicy")
    return policy["TrafficRoutingConfiguration"]["Type"] if policy else "ALL_AT_ONCE"


__all__ = ["Step", "alarm_names", "check_deployment_config", "execution_timeout", "routing_type", "traffic_plan"]
