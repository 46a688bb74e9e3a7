"""moto in server mode, as `python -m moto.server` runs it, with DynamoDB requests taken one at a time
and transactions that cost what they touch.

moto's threaded server handles requests concurrently, and its DynamoDB backend is not safe for
that: concurrent TransactWriteItems calls fail with a 500 ("dictionary changed size during
iteration"), which real DynamoDB never does, so under load the pack stage's batches failed
until they reached the DLQ. Serialising DynamoDB alone keeps S3 and SQS (long polls) concurrent.

moto's TransactWriteItems also deep-copies the whole table once per item of the transaction (to
roll back), so every claim and seal slowed down as the table grew. With requests serialised, the
same all-or-nothing result needs no copy of the table: check every condition first, then write,
keeping only the touched items to restore if a write itself fails.

moto's SQS asks the clock through two naive datetimes (`unix_time_millis`) for every message of a
queue on every SendMessage and ReceiveMessage (visible? delayed?), so with a backlog of thousands
each call cost milliseconds and the load test slowed as its queue grew. The same test reads
`time.time()` once per call here: the same millisecond clock, the same answers.

moto's EventBridge treats a rule without an event pattern as matching every event, so a
schedule-only rule (PackFunction's `rate(1 minute)` seal timer) also received every `Shard Sealed`
event put on the bus. The handler refused them and they came back each visibility timeout, which
in the 10,000-upload run kept hundreds of bogus timer events cycling through the pack worker. On
AWS a rule with only a ScheduleExpression matches no event; here, too.

moto's server asks for the list of its service modules on every request (to route it), and that
list is an `os.listdir` plus one `isdir` per module, about 6% of the server's CPU under load. The
folder does not change while the server runs: it is read once here.

moto's S3 looks a multipart upload up by a bare dict lookup in UploadPart and UploadPartCopy, so a
part sent to an upload that another packer had just completed failed with a 500 (a KeyError), which
botocore retried and then raised as InternalError. S3 answers NoSuchUpload, which the seal handles
(it reads the seal again); here, too.

werkzeug logs every request; at a few hundred requests a second that is the server's own log I/O
for lines nobody reads. Only requests answered with an error (4xx, 5xx) are logged here.

    python -m atelier.local.moto_server HOST PORT
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable

from moto import backends
from moto.dynamodb.comparisons import get_filter_expression
from moto.dynamodb.exceptions import (ConditionalCheckFailed, MockValidationException, MultipleTransactionsException,
                                      TooManyTransactionsException, TransactionCanceledException,
                                      TransactWriteSingleOpException)
from moto.dynamodb.models import DynamoDBBackend
from moto.events.models import Rule
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.s3.exceptions import NoSuchUpload
from moto.s3.models import S3Backend
from moto.server import MotoRequestHandler
from moto.sqs.models import Message, Queue
from werkzeug.serving import run_simple

from atelier.local.iam_rules import patch_iam_rules

DYNAMODB_TARGET = "DynamoDB_"  # X-Amz-Target of every DynamoDB API call


class SerialDynamoDB:
    """WSGI middleware: one DynamoDB request at a time, every other request as it comes."""

    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not environ.get("HTTP_X_AMZ_TARGET", "").startswith(DYNAMODB_TARGET):
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the body is built inside the lock


TRANSACT_OPS = ("ConditionCheck", "Put", "Delete", "Update")


def transact_write_items(backend: DynamoDBBackend, transact_items: list[dict[str, Any]]) -> None:
    """TransactWriteItems with moto's answers, checked before anything is written (see the module
    docstring): conditions first, then the writes, restoring the touched items if one fails."""
    if len(transact_items) > 100:
        raise TooManyTransactionsException()
    planned, errors = _check_transaction(backend, transact_items)
    if any(code is not None for code, _, _ in errors):
        raise TransactionCanceledException(errors)
    before = [(table, key, copy.deepcopy(current)) for _, _, table, key, current in planned]
    for index, (op_type, op, table, key, _) in enumerate(planned):
        try:
            _write(backend, op_type, op, table, key)
        except MockValidationException:
            _restore(backend, before)
            raise
        except Exception as error:  # as moto: the item's failure cancels the transaction
            _restore(backend, before)
            raise TransactionCanceledException([(type(error).__name__, str(error), None) if n == index
                                                else (None, None, None) for n in range(len(planned))]) from error


def _restore(backend: DynamoDBBackend, before: list[tuple[str, dict[str, Any], Any]]) -> None:
    for table, key, item in before:
        if item is None:
            backend.delete_item(table, key)
        else:
            backend.put_item(table, item.to_json()["Attributes"])


def _check_transaction(backend: DynamoDBBackend, transact_items: list[dict[str, Any]]) -> tuple[list, list]:
    planned: list[tuple[str, dict[str, Any], str, dict[str, Any], Any]] = []
    errors: list[tuple[str | None, str | None, dict[str, Any] | None]] = []
    seen: set[tuple[str, str]] = set()
    for item in transact_items:
        if len(item) > 1:
            raise TransactWriteSingleOpException
        op_type, op = next(iter(item.items()))
        old: dict[str, Any] | None = None
        try:
            if op_type not in TRANSACT_OPS:
                raise ValueError("Unsupported transaction operation")
            table, key = op["TableName"], _key(backend, op_type, op)
            marker = (str(table), str(dict(sorted(key.items()))))
            if marker in seen:
                raise MultipleTransactionsException()
            seen.add(marker)
            current = backend.get_item(table, key)
            if op.get("ConditionExpression") is not None and not get_filter_expression(
                    op["ConditionExpression"], op.get("ExpressionAttributeNames"),
                    op.get("ExpressionAttributeValues")).expr(current):
                if op.get("ReturnValuesOnConditionCheckFailure") == "ALL_OLD" and current:
                    old = current.to_json()["Attributes"]
                raise ConditionalCheckFailed(item=old)
            planned.append((op_type, op, table, key, current))
            errors.append((None, None, None))
        except MockValidationException:
            raise
        except ConditionalCheckFailed as failed:
            errors.append(("ConditionalCheckFailed", str(failed.message), old))
        except Exception as error:  # moto reports any other failure per item, as here
            errors.append((type(error).__name__, str(error), old))
    return planned, errors


def _key(backend: DynamoDBBackend, op_type: str, op: dict[str, Any]) -> dict[str, Any]:
    if op_type != "Put":
        return op["Key"]
    table = backend.get_table(op["TableName"])
    key = {table.hash_key_attr: op["Item"][table.hash_key_attr]}
    if table.range_key_attr is not None:
        key[table.range_key_attr] = op["Item"][table.range_key_attr]
    return key


def _write(backend: DynamoDBBackend, op_type: str, op: dict[str, Any], table: str, key: dict[str, Any]) -> None:
    names, values = op.get("ExpressionAttributeNames"), op.get("ExpressionAttributeValues")
    condition = op.get("ConditionExpression")
    if op_type == "Put":
        backend.put_item(table, op["Item"], condition_expression=condition, expression_attribute_names=names,
                         expression_attribute_values=values)
    elif op_type == "Delete":
        backend.delete_item(table, key, condition_expression=condition, expression_attribute_names=names,
                            expression_attribute_values=values)
    elif op_type == "Update":
        backend.update_item(table, key, update_expression=op["UpdateExpression"], condition_expression=condition,
                            expression_attribute_names=names, expression_attribute_values=values)


# --- SQS: one clock reading per call (see the module docstring) ----------------------------------

def _now_ms() -> float:
    """Milliseconds since the epoch: what moto's `unix_time_millis()` returns, without the datetimes."""
    return time.time() * 1000.0


def _message_visible(message: Message) -> bool:
    return _now_ms() > message.visible_at


def _message_delayed(message: Message) -> bool:
    return _now_ms() < message.delayed_until


def _queue_messages(queue: Queue) -> list[Message]:
    """The visible, undelayed messages, as moto's `Queue.messages`, reading the clock once."""
    now = _now_ms()
    return [m for m in queue._messages if now > m.visible_at and not now < m.delayed_until]


def _queue_not_visible(queue: Queue) -> int:
    now = _now_ms()
    return sum(1 for m in queue._messages if not now > m.visible_at)


def _queue_delayed(queue: Queue) -> int:
    now = _now_ms()
    return sum(1 for m in queue._messages if now < m.delayed_until)


def patch_sqs_clock() -> None:
    Message.visible = property(_message_visible)  # type: ignore[method-assign,assignment]
    Message.delayed = property(_message_delayed)  # type: ignore[method-assign,assignment]
    Queue.messages = property(_queue_messages)  # type: ignore[method-assign,assignment]
    Queue.approximate_number_of_messages_not_visible = property(_queue_not_visible)  # type: ignore[method-assign,assignment]
    Queue.approximate_number_of_messages_delayed = property(_queue_delayed)  # type: ignore[method-assign,assignment]


def _send_to_targets_unless_schedule_only(original: Callable[..., None]) -> Callable[..., None]:
    def send_to_targets(rule: Rule, event: Any, *args: Any, **kwargs: Any) -> None:
        if rule.scheduled_expression and not rule.event_pattern.get_pattern():
            return  # a schedule-only rule: fired by its schedule (the local runtime), never by an event
        original(rule, event, *args, **kwargs)
    send_to_targets.patched = True  # type: ignore[attr-defined]
    return send_to_targets


def patch_schedule_rules() -> None:
    """Events put on a bus never reach a rule that has only a ScheduleExpression, as on AWS."""
    if not getattr(Rule.send_to_targets, "patched", False):
        Rule.send_to_targets = _send_to_targets_unless_schedule_only(Rule.send_to_targets)  # type: ignore[method-assign]


def patch_module_list() -> None:
    """Route requests with the service modules listed once, not once per request."""
    if not getattr(backends.list_of_moto_modules, "patched", False):
        modules = tuple(backends.list_of_moto_modules())

        def list_of_moto_modules() -> tuple[str, ...]:
            return modules
        list_of_moto_modules.patched = True  # type: ignore[attr-defined]
        backends.list_of_moto_modules = list_of_moto_modules  # type: ignore[assignment]


def _upload_must_exist(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(backend: S3Backend, bucket_name: str, multipart_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(backend, bucket_name, multipart_id, *args, **kwargs)
        except KeyError:  # the upload's lookup (a completion may remove it between a check and the call)
            if multipart_id in backend.get_bucket(bucket_name).multiparts:
                raise
            raise NoSuchUpload(upload_id=multipart_id) from None
    call.patched = True  # type: ignore[attr-defined]
    return call


MULTIPART_CALLS = ("upload_part", "upload_part_copy")  # a repeated completion already answers as S3 does


def patch_multipart_gone() -> None:
    """A part for an upload that is gone (completed, aborted) is NoSuchUpload, as on S3."""
    for name in MULTIPART_CALLS:
        if not getattr(getattr(S3Backend, name), "patched", False):
            setattr(S3Backend, name, _upload_must_exist(getattr(S3Backend, name)))


class ErrorRequestsOnly(logging.Filter):
    """Pass werkzeug's request lines for 4xx and 5xx answers; its other messages pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 3 and str(args[1]).isdigit():  # log_request: (request line, status, size)
            return int(str(args[1])) >= 400
        return True


def main(host: str, port: int) -> None:
    os.environ.setdefault("MOTO_PORT", str(port))  # moto builds queue URLs and the like with it
    DynamoDBBackend.transact_write_items = transact_write_items  # type: ignore[method-assign]
    patch_sqs_clock()
    patch_schedule_rules()
    patch_module_list()
    patch_multipart_gone()
    patch_iam_rules()  # used only under IAM enforcement (atelier/local/enforcement.py)
    logging.getLogger("werkzeug").addFilter(ErrorRequestsOnly())
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, SerialDynamoDB(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
