"""DeploymentConfig for CreateEndpoint / UpdateEndpoint: its checks and the traffic plan it implies.

Pure: no clients, no threads. `check_deployment_config` answers as SageMaker does for a request
that breaks the API's shape (ValidationException, "N validation errors detected: ..."), then for
one that breaks the documented rules (canary <= 50% of the fleet, linear steps 10-50%).
`traffic_plan` turns a checked config into the steps the endpoint runs: each step a share of the
invocations sent to the new (green) fleet and a baking period during which the alarms are watched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from atelier.local.sagemaker.validation import validation_error

ROUTING_TYPES = ("ALL_AT_ONCE", "CANARY", "LINEAR")
CAPACITY_TYPES = ("INSTANCE_COUNT", "CAPACITY_PERCENT")
WAIT_RANGE = (0, 3600)  # WaitIntervalInSeconds and TerminationWaitInSeconds
EXECUTION_TIMEOUT_RANGE = (600, 28800)  # MaximumExecutionTimeoutInSeconds
MAX_ALARMS = 10
ROOT = "deploymentConfig"


@dataclass(frozen=True)
class Step:
    """Send `share` of the invocations to the green fleet, then bake for `bake_seconds`."""

    share: float
    bake_seconds: int
    bake_member: str  # the member the baking period comes from, for status messages


class _Errors:
    """Shape errors collected as AWS's request validation reports them (all at once)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, value: Any, path: str, constraint: str) -> None:
        shown = "null" if value is None else f"'{value}'"
        self.messages.append(f"Value {shown} at '{path}' failed to satisfy constraint: {constraint}")

    def required(self, parent: dict[str, Any], member: str, path: str) -> Any:
        value = parent.get(member)
        if value is None:
            self.add(None, f"{path}.{_camel(member)}", "Member must not be null")
        return value

    def integer(self, parent: dict[str, Any], member: str, path: str, low: int | None = None,
                high: int | None = None, required: bool = False) -> None:
        value = self.required(parent, member, path) if required else parent.get(member)
        if value is None:
            return
        where = f"{path}.{_camel(member)}"
        if not isinstance(value, int) or isinstance(value, bool):
            self.add(value, where, "Member must be an integer")
        elif low is not None and value < low:
            self.add(value, where, f"Member must have value greater than or equal to {low}")
        elif high is not None and value > high:
            self.add(value, where, f"Member must have value less than or equal to {high}")

    def enum(self, parent: dict[str, Any], member: str, path: str, allowed: tuple[str, ...]) -> None:
        value = self.required(parent, member, path)
        if value is not None and value not in allowed:
            self.add(value, f"{path}.{_camel(member)}",
                     f"Member must satisfy enum value set: [{', '.join(allowed)}]")

    def raise_if_any(self) -> None:
        if self.messages:
            count = len(self.messages)
            raise validation_error(f"{count} validation error{'s' if count > 1 else ''} detected: "
                                   + "; ".join(self.messages))


def _camel(member: str) -> str:
    return member[0].lower() + member[1:]


def check_deployment_config(config: Any, instance_count: int) -> dict[str, Any]:
    """The config, or the ValidationException SageMaker gives; instance_count is the new variant's."""
    if not isinstance(config, dict):
        raise validation_error(f"1 validation error detected: Value '{config}' at '{ROOT}' failed to satisfy "
                               "constraint: Member must be a structure")
    if "RollingUpdatePolicy" in config:
        raise validation_error("The local SageMaker emulates BlueGreenUpdatePolicy only, not RollingUpdatePolicy")
    errors = _Errors()
    policy = config.get("BlueGreenUpdatePolicy")
    if policy is not None:
        _check_policy_shape(policy, errors)
    rollback = config.get("AutoRollbackConfiguration")
    if rollback is not None:
        _check_alarms_shape(rollback, errors)
    errors.raise_if_any()
    if policy is not None:
        _check_policy_rules(policy, instance_count)
    return config


def _check_policy_shape(policy: dict[str, Any], errors: _Errors) -> None:
    path = f"{ROOT}.blueGreenUpdatePolicy"
    routing = errors.required(policy, "TrafficRoutingConfiguration", path)
    if routing is not None:
        routing_path = f"{path}.trafficRoutingConfiguration"
        errors.enum(routing, "Type", routing_path, ROUTING_TYPES)
        errors.integer(routing, "WaitIntervalInSeconds", routing_path, *WAIT_RANGE, required=True)
        for member in ("CanarySize", "LinearStepSize"):
            if routing.get(member) is not None:
                size_path = f"{routing_path}.{_camel(member)}"
                errors.enum(routing[member], "Type", size_path, CAPACITY_TYPES)
                errors.integer(routing[member], "Value", size_path, 1, required=True)
    errors.integer(policy, "TerminationWaitInSeconds", path, *WAIT_RANGE)
    errors.integer(policy, "MaximumExecutionTimeoutInSeconds", path, *EXECUTION_TIMEOUT_RANGE)


def _check_alarms_shape(rollback: dict[str, Any], errors: _Errors) -> None:
    path = f"{ROOT}.autoRollbackConfiguration.alarms"
    alarms = rollback.get("Alarms")
    if alarms is None:
        return
    if not 1 <= len(alarms) <= MAX_ALARMS:
        errors.add(alarms, path, f"Member must have length {'less' if alarms else 'greater'} than or equal to "
                                 f"{MAX_ALARMS if alarms else 1}")
    for index, alarm in enumerate(alarms, start=1):
        name = alarm.get("AlarmName")
        if not isinstance(name, str) or not name.strip() or len(name) > 255:
            errors.add(name, f"{path}.{index}.member.alarmName",
                       "Member must have length between 1 and 255 and not be blank")


def _check_policy_rules(policy: dict[str, Any], instance_count: int) -> None:
    """The rules the API reference states in prose (TrafficRoutingConfig, BlueGreenUpdatePolicy)."""
    routing = policy["TrafficRoutingConfiguration"]
    kind = routing["Type"]
    if kind == "CANARY":
        share = _share(routing, "CanarySize", instance_count)
        if share > 0.5:
            raise validation_error(f"CanarySize {_size_text(routing['CanarySize'])} is more than 50% of the "
                                   f"variant's total instance count ({instance_count}).")
    elif kind == "LINEAR":
        share = _share(routing, "LinearStepSize", instance_count)
        if not 0.1 <= share <= 0.5:
            raise validation_error(f"LinearStepSize {_size_text(routing['LinearStepSize'])} must be 10-50% of the "
                                   f"variant's total instance count ({instance_count}).")
    timeout = policy.get("MaximumExecutionTimeoutInSeconds")
    waits = policy.get("TerminationWaitInSeconds", 0) + routing["WaitIntervalInSeconds"]
    if timeout is not None and timeout <= waits:
        raise validation_error(f"MaximumExecutionTimeoutInSeconds ({timeout}) must be larger than the total waiting "
                               f"time in TerminationWaitInSeconds and WaitIntervalInSeconds ({waits}).")


def _share(routing: dict[str, Any], member: str, instance_count: int) -> float:
    size = routing.get(member)
    if size is None:
        raise validation_error(f"{member} must be specified when the TrafficRoutingConfiguration Type is "
                               f"{routing['Type']}.")
    if size["Type"] == "CAPACITY_PERCENT":
        if size["Value"] > 100:
            raise validation_error(f"{member} Value {size['Value']} is more than 100 percent.")
        return size["Value"] / 100
    return size["Value"] / max(instance_count, 1)


def _size_text(size: dict[str, Any]) -> str:
    return f"{size['Value']}%" if size["Type"] == "CAPACITY_PERCENT" else f"{size['Value']} instance(s)"


def alarm_names(config: dict[str, Any] | None) -> list[str]:
    return [alarm["AlarmName"] for alarm in ((config or {}).get("AutoRollbackConfiguration") or {}).get("Alarms", [])]


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
