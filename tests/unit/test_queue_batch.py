"""core.queue_batch: an SQS batch as (message id, message) pairs and the ids of records that did not parse."""

from __future__ import annotations

from pydantic import BaseModel

from core.queue_batch import parse_batch


class Ping(BaseModel):
    n: int


def event(*bodies: str) -> dict:
    return {"Records": [{"messageId": f"m-{i}", "body": body} for i, body in enumerate(bodies)]}


def test_each_parsed_message_keeps_its_own_id_in_batch_order() -> None:
    batch = parse_batch(event('{"n": 1}', "not json", '{"n": 3}', '{"n": "three"}', '{"n": 5}'), Ping)

    assert batch.messages == [("m-0", Ping(n=1)), ("m-2", Ping(n=3)), ("m-4", Ping(n=5))]
    assert batch.failures == ["m-1", "m-3"]


def test_a_record_without_a_body_fails_alone() -> None:
    records = event('{"n": 1}')["Records"] + [{"messageId": "m-1"}]

    batch = parse_batch({"Records": records}, Ping)

    assert (batch.messages, batch.failures) == ([("m-0", Ping(n=1))], ["m-1"])


def test_the_response_returns_the_unparseable_records_then_the_failed_ones() -> None:
    batch = parse_batch(event("{}", '{"n": 2}'), Ping)

    assert batch.response(["m-1"]) == {"batchItemFailures": [{"itemIdentifier": "m-0"}, {"itemIdentifier": "m-1"}]}
    assert parse_batch(event('{"n": 1}'), Ping).response() == {"batchItemFailures": []}
