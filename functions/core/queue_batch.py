"""Parse an SQS batch into typed messages, keeping the ids of records that do not parse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Iterable, TypeVar

from aws_lambda_powertools import Logger
from pydantic import BaseModel, ValidationError

logger = Logger(child=True)
M = TypeVar("M", bound=BaseModel)


@dataclass
class ParsedBatch(Generic[M]):
    """(message id, message) of each record that parsed, in batch order; the ids of those that did not."""
    messages: list[tuple[str, M]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def response(self, failed: Iterable[str] = ()) -> dict:
        """The partial batch response: the unparseable records, then `failed`, go back to the queue."""
        return {"batchItemFailures": [{"itemIdentifier": i} for i in [*self.failures, *failed]]}


def parse_batch(event: dict, model: type[M]) -> ParsedBatch[M]:
    batch: ParsedBatch[M] = ParsedBatch()
    for record in event.get("Records", []):
        try:
            batch.messages.append((record["messageId"], model.model_validate_json(record["body"])))
        except (ValidationError, KeyError) as exc:
            logger.error("malformed message", extra={"message_id": record.get("messageId"), "error": str(exc)})
            batch.failures.append(record["messageId"])
    return batch
