"""Every change the local stack makes to moto's internals, in one shim pinned to the moto it was written for.

Each patch below makes moto's server answer as AWS does, or as fast as the load tests need; a `Patch`
names the moto code it replaces or relies on (`module:Qualified.name`) and the sha256 of that code's
source at MOTO_VERSION. tests/local/test_moto_shim.py fails when moto is not MOTO_VERSION (constraints.txt
pins it) or when an upgrade changes any code a patch names, so each patch is read again before it runs on
new code. docs/moto-upstream.md holds the upstream issue text for each. `apply()` installs them all, once.

- dynamodb-transactions: TransactWriteItems checked before anything is written, without a deep copy of
  the table per item (atelier/local/moto_transactions.py).
- sqs-clock: moto's SQS asks the clock through two naive datetimes (`unix_time_millis`) for every
  message of a queue on every SendMessage and ReceiveMessage (visible? delayed?), so with a backlog of
  thousands each call cost milliseconds and the load test slowed as its queue grew. The same test reads
  `time.time()` once per call here: the same millisecond clock, the same answers.
- schedule-only-rules: moto's EventBridge treats a rule without an event pattern as matching every
  event, so a schedule-only rule (PackFunction's `rate(1 minute)` seal timer) also received every
  `Shard Sealed` event put on the bus. On AWS a rule with only a ScheduleExpression matches no event;
  here, too.
- module-list: moto's server asks for the list of its service modules on every request (to route it),
  an `os.listdir` plus one `isdir` per module, about 6% of the server's CPU under load. The folder does
  not change while the server runs: it is read once here.
- multipart-gone: moto's S3 looks a multipart upload up by a bare dict lookup in UploadPart and
  UploadPartCopy, so a part sent to an upload that another packer had just completed failed with a 500
  (a KeyError). S3 answers NoSuchUpload, which the seal handles; here, too.
- iam-rules: four IAM rules moto's enforcement leaves out (atelier/local/iam_rules.py).
- s3-checksums: S3 refuses a PutObject or UploadPart whose body does not match the checksum it names (400
  BadDigest); moto stored it, and every later GET failed botocore's check (atelier/local/s3_checksums.py).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moto import backends
from moto.dynamodb.models import DynamoDBBackend
from moto.events.models import Rule
from moto.s3.exceptions import NoSuchUpload
from moto.s3.models import S3Backend
from moto.sqs.models import Message, Queue

from atelier.local.iam_rules import patch_iam_rules
from atelier.local.moto_transactions import transact_write_items
from atelier.local.s3_checksums import patch_s3_checksums

MOTO_VERSION = "5.2.6"


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
    """Visible and delayed messages counted with one clock reading per call."""
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


def patch_dynamodb_transactions() -> None:
    DynamoDBBackend.transact_write_items = transact_write_items  # type: ignore[method-assign]


@dataclass(frozen=True)
class Patch:
    name: str
    apply: Callable[[], None]
    targets: dict[str, str]  # moto code it replaces or relies on -> sha256 (16 hex) of its source at MOTO_VERSION


PATCHES = (
    Patch("dynamodb-transactions", patch_dynamodb_transactions, {
        "moto.dynamodb.models:DynamoDBBackend.transact_write_items": "c3c395e934006404",
        "moto.dynamodb.comparisons:get_filter_expression": "25a6b4630a974d7b",
    }),
    Patch("sqs-clock", patch_sqs_clock, {
        "moto.sqs.models:Message.visible": "de0d3512ec1a913c", "moto.sqs.models:Message.delayed": "f33750c7c41004db",
        "moto.sqs.models:Queue.messages": "8446f762e9f146e7",
        "moto.sqs.models:Queue.approximate_number_of_messages_not_visible": "387252cd3572cdd8",
        "moto.sqs.models:Queue.approximate_number_of_messages_delayed": "1068fe85b526f383",
    }),
    Patch("schedule-only-rules", patch_schedule_rules, {"moto.events.models:Rule.send_to_targets": "8e7ba7ac1766c8af"}),
    Patch("module-list", patch_module_list, {"moto.backends:list_of_moto_modules": "f7f966c4452733db"}),
    Patch("multipart-gone", patch_multipart_gone, {
        "moto.s3.models:S3Backend.upload_part": "a97f43a6d7d91c81", "moto.s3.models:S3Backend.upload_part_copy": "f23d0fb30493b6a6",
    }),
    Patch("iam-rules", patch_iam_rules, {
        "moto.iam.access_control:IAMRequestBase.check_action_permitted": "b88277b037639e09",
        "moto.iam.access_control:IAMRequestBase.__init__": "c4c3427bf20b0ac7",  # the action named from the response's _get_action
        "moto.core.responses:BaseResponse._get_action": "2cada0baea8f0206",  # which moto 5.2.6 names by the operation
        "moto.core.authorization:ActionAuthenticatorMixin._authenticate_and_authorize_action": "bfa58894790d3e79",
    }),
    Patch("s3-checksums", patch_s3_checksums, {
        "moto.s3.responses:S3Response._get_checksum": "144f31ab82aebca2",
        "moto.s3.utils:compute_checksum": "cdce1c23ae4136fb",
    }),
)


def apply() -> None:
    """Install every patch (each is idempotent)."""
    for patch in PATCHES:
        patch.apply()


def source_fingerprint(target: str) -> str:
    """sha256 (16 hex) of the source moto's installed files hold for `module:Qualified.name`; read from
    the file, so a patch installed in this process does not hide what moto ships."""
    module, _, qualname = target.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec and spec.origin, f"moto has no module {module}"
    text = open(spec.origin, encoding="utf-8").read()
    nodes: list[Any] = ast.parse(text).body
    found = None
    for part in qualname.split("."):
        found = next((node for node in nodes if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.name == part), None)
        if found is None:
            raise LookupError(f"moto {module} has no {qualname}")
        nodes = found.body
    return hashlib.sha256(ast.get_source_segment(text, found).encode()).hexdigest()[:16]
