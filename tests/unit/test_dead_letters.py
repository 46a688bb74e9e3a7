"""core.redrive.dead_letters: what the evidence says of a dead letter, and when a transient one goes back."""

from __future__ import annotations

import json

import pytest

from core.redrive import dead_letters
from core.redrive.dead_letters import Action, Ledger, Letter, RedrivePolicy

POLICY = RedrivePolicy(cap=3, backoff_s=60, memory_s=3600)
NOW = 1_800_000_000.0
NOTIFICATION = json.dumps({"Records": [{"eventName": "ObjectCreated:Put", "s3": {
    "bucket": {"name": "uploads"}, "object": {"key": "p/a.png", "size": 3, "eTag": "abc"}}}]})
SEALED = {"version": "0", "id": "1", "time": "2026-11-29T12:00:00Z", "source": "atelier.pack",
          "detail-type": "Shard Sealed", "resources": [], "detail": {"shard_id": "shard-1"}}
TICK = {"version": "0", "id": "2", "source": "aws.events", "detail-type": "Scheduled Event",
        "resources": ["arn:aws:events:us-east-1:123456789012:rule/atelier-PackFunctionSealTimer"], "detail": {}}


def judge(body: str, ledger: Ledger = Ledger(), contract: str = "s3-notification", **attributes: str):
    return dead_letters.judge(Letter(body, attributes), dead_letters.CONTRACTS[contract], ledger, POLICY, NOW)


def test_a_first_dead_letter_that_fits_its_contract_goes_back_at_once() -> None:
    decision = judge(NOTIFICATION)

    assert (decision.action, decision.reason) == (Action.REDRIVE, "transient: redrive 1 of 3")


@pytest.mark.parametrize(("contract", "body", "error"), [
    ("s3-notification", "not json {", "not JSON"),
    ("s3-notification", '{"Message": "hello"}', "no Records in S3 notification"),
    ("sample", '{"bucket": "b"}', "validation error"),
    ("import-shard", '{"batch_id": "x"}', "validation error"),
    ("event", '{"detail": {}}', "not an EventBridge event"),
])
def test_a_body_its_consumer_cannot_parse_is_poison_at_once(contract: str, body: str, error: str) -> None:
    decision = judge(body, contract=contract)

    assert decision.action is Action.HOLD
    assert decision.reason.startswith("poison: does not match its queue's contract: ") and error in decision.reason


def test_after_the_cap_a_message_is_poison_with_the_last_error_aws_attached() -> None:
    decision = judge(json.dumps(SEALED), Ledger(redrives=3, last_redrive_at=NOW - 10), "event",
                     ErrorCode="200", ErrorMessage="KeyError: 'shard_id'")

    assert decision.action is Action.HOLD
    assert decision.reason == ("poison: failed again after 3 automatic redrives, each after its queue's full "
                               "retries; last error: ErrorMessage=KeyError: 'shard_id'; ErrorCode=200")


def test_after_the_cap_a_queue_message_says_sqs_kept_no_error() -> None:
    decision = judge(NOTIFICATION, Ledger(redrives=3, last_redrive_at=NOW - 10))

    assert decision.action is Action.HOLD
    assert decision.reason.endswith("last error: none recorded (SQS keeps no error; see the consumer logs)")


def test_one_redrive_short_of_the_cap_it_still_goes_back() -> None:
    key = dead_letters.identity(NOTIFICATION)
    waited = dead_letters.backoff_s(2, POLICY, key)

    decision = judge(NOTIFICATION, Ledger(redrives=2, last_redrive_at=NOW - waited))

    assert (decision.action, decision.reason) == (Action.REDRIVE, "transient: redrive 3 of 3")


def test_a_redriven_message_waits_out_its_backoff_before_the_next_redrive() -> None:
    key = dead_letters.identity(NOTIFICATION)
    due = dead_letters.backoff_s(1, POLICY, key)

    decision = judge(NOTIFICATION, Ledger(redrives=1, last_redrive_at=NOW - 5))

    assert decision.action is Action.WAIT
    assert decision.wait_s == pytest.approx(due - 5)


def test_backoff_doubles_with_each_redrive_and_its_jitter_stays_in_the_upper_half() -> None:
    keys = [dead_letters.identity(f"message {n}") for n in range(200)]
    for redrives in (1, 2, 3, 4):
        full = POLICY.backoff_s * 2 ** (redrives - 1)
        waits = [dead_letters.backoff_s(redrives, POLICY, k) for k in keys]
        assert all(full / 2 <= w <= full for w in waits)
        assert len({round(w, 3) for w in waits}) > 150  # spread, so a burst does not return as one
    assert dead_letters.backoff_s(0, POLICY, keys[0]) == 0
    assert dead_letters.backoff_s(3, POLICY, keys[0]) == 2 * dead_letters.backoff_s(2, POLICY, keys[0])


def test_a_count_older_than_the_memory_is_a_new_incident() -> None:
    decision = judge(NOTIFICATION, Ledger(redrives=3, last_redrive_at=NOW - POLICY.memory_s - 1))

    assert (decision.action, decision.reason) == (Action.REDRIVE, "transient: redrive 1 of 3")


def test_a_message_marked_poison_stays_with_its_reason() -> None:
    decision = judge(NOTIFICATION, **{dead_letters.VERDICT_ATTRIBUTE: "poison", dead_letters.ERROR_ATTRIBUTE: "why"})

    assert (decision.action, decision.reason) == (Action.HOLD, "why")


def test_a_failed_tick_is_dropped_however_many_came_before() -> None:
    decision = judge(json.dumps(TICK), Ledger(redrives=10, last_redrive_at=NOW), "event")

    assert decision.action is Action.DROP


@pytest.mark.parametrize("error", ["Rate exceeded", "ThrottlingException", "Task timed out after 60.00 seconds",
                                   "Runtime.ExitError", "RequestId: 1 Error: Runtime exited with signal: killed",
                                   "ServiceUnavailable", "429", ""])
def test_throttling_timeouts_and_killed_invocations_are_transient(error: str) -> None:
    assert dead_letters.failure_kind(error) == "transient"


def test_another_error_is_unknown_and_still_redriven_until_the_cap() -> None:
    assert dead_letters.failure_kind("KeyError: 'shard_id'") == "unknown"
    decision = judge(json.dumps(SEALED), contract="event", ERROR_MESSAGE="KeyError: 'shard_id'")
    assert (decision.action, decision.reason) == (
        Action.REDRIVE, "unknown: redrive 1 of 3 (ERROR_MESSAGE=KeyError: 'shard_id')")


def test_a_re_put_event_keeps_its_identity_though_its_id_and_time_change() -> None:
    again = {**SEALED, "id": "another", "time": "2026-11-29T13:00:00Z"}

    assert dead_letters.identity(json.dumps(again)) == dead_letters.identity(json.dumps(SEALED))
    assert dead_letters.identity(json.dumps({**SEALED, "detail": {"shard_id": "shard-2"}})) \
        != dead_letters.identity(json.dumps(SEALED))
