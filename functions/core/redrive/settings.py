"""RedriveFunction's settings: every DLQ of the stack, and the policy that empties them (core.redrive.redriver)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from core.redrive.dead_letters import CONTRACTS, RedrivePolicy
from core.settings import StageSettings, settings

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
    # automatic redrives a message gets; failing after the last one proves it poison
    redrive_cap: int = Field(3, ge=1, le=20, validation_alias="DEAD_LETTER_REDRIVE_CAP")  # a tuning knob
    backoff_s: int = Field(300, ge=0, le=43200, validation_alias="DEAD_LETTER_BACKOFF_S")  # before the second; doubles after
    # a redrive count untouched this long is forgotten (a new incident): a tuning knob
    memory_s: int = Field(86400, ge=1, validation_alias="DEAD_LETTER_MEMORY_S")

    @field_validator("queues", mode="before")
    @classmethod
    def _queues(cls, raw: Any) -> Any:
        return _queues(raw) if isinstance(raw, str) else raw

    @property
    def policy(self) -> RedrivePolicy:
        return RedrivePolicy(cap=self.redrive_cap, backoff_s=self.backoff_s, memory_s=self.memory_s)


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
