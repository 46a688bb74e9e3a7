"""Parse an SQS batch into typed messages, keeping the ids of records that do not parse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from aws_lambda_powertools import Logger
from pydantic import BaseModel, ValidationError

logger = Logger(child=True)
M = TypeVar("M", bound=BaseModel)


@dataclass
class ParsedBatch(Generic[M]):
    messages: list[M] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def response(self) -> dict:
        """The partial batch response: only the unparseable records go back to the queue."""
        return {"batchItemFailures": [{"itemIdentifier": i} for i in self.failures]}


def parse_batch(event: dict, model: type[M]) -> ParsedBatch[M]:
    batch: ParsedBatch[M] = ParsedBatch()
    for record in event.get("Records", []):
        try:
            batch.messages.append(model.model_validate_json(record["body"]))
        except (ValidationError, KeyError) as exc:
            logger.error("malformed message", extra={"message_id": record.get("messageId"), "error": str(exc)})
            batch.failures.append(record["messageId"])
    return batch
