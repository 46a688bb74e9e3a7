"""RedriveFunction's settings: every DLQ of the stack, and the policy that empties them (core.redrive.redriver)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from core.redrive.dead_letters import CONTRACTS, RedrivePolicy
from core.settings import StageSettings, given, settings

DEAD_LETTER_MEMORY_S = 86400  # a redrive count untouched this long is forgotten (a new incident): a tuning knob


@dataclass(frozen=True)
class DeadLetterQueue:
    # Queue names, not URLs: the same on AWS, under moto and in events/env.json (`sam local invoke`)
    name: str
    contract: str  # core.redrive.dead_letters.CONTRACTS: what its messages' consumer parses
    source: str = ""  # the queue it redrives to; empty: it holds events, re-put on the bus


@settings
class RedriveSettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    event_bus: str = Field(validation_alias="EVENT_BUS_NAME")
    queues: dict[str, DeadLetterQueue] = Field(validation_alias="DEAD_LETTER_QUEUES")  # by logical id, e.g. UploadsDLQ
    policy: RedrivePolicy  # from DEAD_LETTER_REDRIVE_CAP, DEAD_LETTER_BACKOFF_S, DEAD_LETTER_MEMORY_S

    @model_validator(mode="before")
    @classmethod
    def _from_variables(cls, values: Any) -> Any:
        values = given(values)
        if not isinstance(values, dict):
            return values
        if isinstance(raw := values.get("DEAD_LETTER_QUEUES"), str):
            values["DEAD_LETTER_QUEUES"] = _queues(raw)
        if "policy" not in values:
            values["policy"] = RedrivePolicy(
                cap=_at_least(values, "DEAD_LETTER_REDRIVE_CAP", 1), backoff_s=_at_least(values, "DEAD_LETTER_BACKOFF_S", 0),
                memory_s=_at_least({"DEAD_LETTER_MEMORY_S": DEAD_LETTER_MEMORY_S, **values}, "DEAD_LETTER_MEMORY_S", 1))
        return values


def _queues(raw: str) -> dict[str, DeadLetterQueue]:
    try:
        queues = {name: DeadLetterQueue(name=q["queue"], contract=q["contract"], source=q.get("source", ""))
                  for name, q in json.loads(raw).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"DEAD_LETTER_QUEUES is not a JSON object of {{logical id: {{queue, contract[, source]}}}}: "
                         f"{exc}") from None
    if unknown := {name for name, q in queues.items() if q.contract not in CONTRACTS}:
        raise ValueError(f"DEAD_LETTER_QUEUES: {sorted(unknown)} name no contract of {sorted(CONTRACTS)}")
    return queues


def _at_least(values: dict[str, Any], name: str, low: int) -> int:
    raw = values.get(name)
    if raw is None or not str(raw).strip():
        raise ValueError(f"environment variable {name} is not set (template.yaml sets it)")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ValueError(f"{name}={value} is outside {low}..inf")
    return value
