"""atelier.local.moto_server and the patches of atelier.local.moto_shim: DynamoDB requests one at a time,
everything else concurrently, transactions that check every condition before writing, and each patch's behaviour."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.dynamodb.models import DynamoDBBackend

from atelier.local.moto_server import SerialDynamoDB
from atelier.local.moto_transactions import transact_write_items


def slow_app(log: list[str], seconds: float = 0.05):
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        name = environ["name"]
        log.append(f"start {name}")
        time.sleep(seconds)
        log.append(f"end {name}")
        return [b"ok"]
    return app


def call_together(app: Any, environs: list[dict[str, Any]]) -> None:
    threads = [threading.Thread(target=lambda e=e: app(e, lambda *a: None)) for e in environs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_dynamodb_requests_never_overlap() -> None:
    log: list[str] = []
    calls = [{"name": str(i), "HTTP_X_AMZ_TARGET": "DynamoDB_20120810.TransactWriteItems"} for i in range(4)]

    call_together(SerialDynamoDB(slow_app(log)), calls)

    assert all(log[i].startswith("start") and log[i + 1] == log[i].replace("start", "end")
               for i in range(0, len(log), 2))


def test_other_requests_still_run_side_by_side() -> None:
    log: list[str] = []
    calls = [{"name": str(i), "HTTP_X_AMZ_TARGET": "AmazonSQS.ReceiveMessage"} for i in range(4)]

    call_together(SerialDynamoDB(slow_app(log, seconds=0.2)), calls)

    # every request started before the first one ended
    assert all(entry.startswith("start") for entry in log[:4])


# --- TransactWriteItems without copying the table ----------------------------------------------------

@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's DynamoDB with the local stack's transactions, and one table holding item `kept`."""
    monkeypatch.setattr(DynamoDBBackend, "transact_write_items", transact_write_items)
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        dynamodb.create_table(TableName="t", KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                              AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                              BillingMode="PAY_PER_REQUEST")
        dynamodb.put_item(TableName="t", Item={"pk": {"S": "kept"}, "n": {"N": "1"}})
        yield dynamodb


def keys(dynamodb: Any) -> dict[str, str]:
    return {i["pk"]["S"]: i.get("n", {}).get("N") for i in dynamodb.scan(TableName="t")["Items"]}


def put(pk: str) -> dict[str, Any]:
    return {"Put": {"TableName": "t", "Item": {"pk": {"S": pk}}, "ConditionExpression": "attribute_not_exists(pk)"}}


def bump(pk: str, expected: str) -> dict[str, Any]:
    return {"Update": {"TableName": "t", "Key": {"pk": {"S": pk}}, "UpdateExpression": "SET n = :new",
                       "ConditionExpression": "n = :old",
                       "ExpressionAttributeValues": {":new": {"N": "2"}, ":old": {"N": expected}}}}


def test_a_transaction_writes_all_of_its_items(table: Any) -> None:
    table.transact_write_items(TransactItems=[put("new"), bump("kept", "1")])

    assert keys(table) == {"kept": "2", "new": None}


def test_a_failed_condition_writes_nothing_and_names_the_item(table: Any) -> None:
    with pytest.raises(ClientError) as raised:
        table.transact_write_items(TransactItems=[put("new"), bump("kept", "7")])

    assert raised.value.response["Error"]["Code"] == "TransactionCanceledException"
    assert [r["Code"] for r in raised.value.response["CancellationReasons"]] == ["None", "ConditionalCheckFailed"]
    assert keys(table) == {"kept": "1"}


def test_one_item_twice_in_a_transaction_is_a_validation_error(table: Any) -> None:
    with pytest.raises(ClientError) as raised:
        table.transact_write_items(TransactItems=[put("new"), bump("new", "1")])

    assert raised.value.response["Error"]["Code"] == "ValidationException"
    assert keys(table) == {"kept": "1"}


def test_a_write_that_fails_after_the_checks_restores_what_was_written(table: Any) -> None:
    # an update expression naming a value it was not given fails only when it is applied
    broken = {"Update": {"TableName": "t", "Key": {"pk": {"S": "kept"}}, "UpdateExpression": "SET n = :missing"}}

    with pytest.raises(ClientError):
        table.transact_write_items(TransactItems=[put("new"), broken])

    assert keys(table) == {"kept": "1"}


# --- SQS: one clock reading per call -----------------------------------------------------------------

@pytest.fixture
def sqs_clock_patched() -> Iterator[None]:
    from moto.sqs.models import Message, Queue

    from atelier.local.moto_shim import patch_sqs_clock
    names = {Message: ("visible", "delayed"),
             Queue: ("messages", "approximate_number_of_messages_not_visible", "approximate_number_of_messages_delayed")}
    saved = {(owner, name): owner.__dict__[name] for owner, attributes in names.items() for name in attributes}
    patch_sqs_clock()
    yield
    for (owner, name), value in saved.items():
        setattr(owner, name, value)


def counts(sqs: Any, url: str) -> tuple[int, int, int]:
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return (int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"]),
            int(attributes["ApproximateNumberOfMessagesDelayed"]))


def test_the_patched_sqs_clock_keeps_visibility_and_delays(sqs_clock_patched: None) -> None:
    with mock_aws():
        sqs = boto3.client("sqs", region_name="us-east-1")
        url = sqs.create_queue(QueueName="q", Attributes={"VisibilityTimeout": "1"})["QueueUrl"]
        sqs.send_message(QueueUrl=url, MessageBody="now")
        sqs.send_message(QueueUrl=url, MessageBody="later", DelaySeconds=1)
        assert counts(sqs, url) == (1, 0, 1)

        first = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
        assert [m["Body"] for m in first] == ["now"]  # the delayed one is not yet deliverable
        assert counts(sqs, url) == (0, 1, 1)
        assert sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", []) == []

        time.sleep(1.2)  # the delay and the visibility timeout have both passed
        again = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
        assert sorted(m["Body"] for m in again) == ["later", "now"]
        for message in again:
            sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
        assert counts(sqs, url) == (0, 0, 0)


# --- EventBridge: schedule-only rules match no event ------------------------------------------------

@pytest.fixture
def schedule_rules_patched() -> Iterator[None]:
    from moto.events.models import Rule

    from atelier.local.moto_shim import patch_schedule_rules
    saved = Rule.__dict__["send_to_targets"]
    patch_schedule_rules()
    yield
    Rule.send_to_targets = saved


def rule_to_queue(events: Any, sqs: Any, name: str, **rule: Any) -> str:
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name=name, **rule)
    events.put_targets(Rule=name, Targets=[{"Id": "q", "Arn": arn}])
    return url


def test_an_event_reaches_pattern_rules_and_never_a_schedule_only_rule(schedule_rules_patched: None) -> None:
    with mock_aws():
        events = boto3.client("events", region_name="us-east-1")
        sqs = boto3.client("sqs", region_name="us-east-1")
        timer = rule_to_queue(events, sqs, "timer", ScheduleExpression="rate(1 minute)")
        sealed = rule_to_queue(events, sqs, "sealed", EventPattern='{"detail-type": ["Shard Sealed"]}')
        events.put_events(Entries=[{"Source": "atelier.pack", "DetailType": "Shard Sealed", "Detail": "{}"}])
        assert counts(sqs, sealed)[0] == 1
        assert counts(sqs, timer)[0] == 0  # unpatched moto delivers it here too


# --- Routing: the module list is read once --------------------------------------------------------

@pytest.fixture
def module_list_patched() -> Iterator[None]:
    from moto import backends

    from atelier.local.moto_shim import patch_module_list
    saved = backends.list_of_moto_modules
    patch_module_list()
    yield
    backends.list_of_moto_modules = saved


def test_the_module_list_is_read_once_and_still_routes(module_list_patched: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from moto import backends
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    def no_listing(path: str) -> list[str]:
        raise AssertionError("the module folder was read again")
    monkeypatch.setattr("os.listdir", no_listing)
    modules = backends.list_of_moto_modules()
    assert {"s3", "sqs", "dynamodb", "events"} <= set(modules)
    assert not any(m.startswith("__") for m in modules)
    app = DomainDispatcherApplication(create_backend_app)
    assert app.get_backend_for_host("sqs") == "sqs"  # a host named after a module routes to it


# --- Request log: errors only ----------------------------------------------------------------------

def request_record(status: str) -> logging.LogRecord:
    return logging.LogRecord("werkzeug", logging.INFO, __file__, 1, '127.0.0.1 - - [x] "%s" %s %s\n',
                             ("GET /bucket/key HTTP/1.1", status, "-"), None)


def test_the_request_log_keeps_errors_and_drops_successes() -> None:
    from atelier.local.moto_server import ErrorRequestsOnly
    keep = ErrorRequestsOnly().filter
    assert not keep(request_record("200"))
    assert not keep(request_record("304"))
    assert keep(request_record("404"))
    assert keep(request_record("500"))
    other = logging.LogRecord("werkzeug", logging.INFO, __file__, 1, " * Running on %s", ("http://x",), None)
    assert keep(other)  # not a request line: kept


# --- S3: a part for an upload that is gone is NoSuchUpload ----------------------------------------

@pytest.fixture
def multipart_gone_patched() -> Iterator[None]:
    from moto.s3.models import S3Backend

    from atelier.local.moto_shim import MULTIPART_CALLS, patch_multipart_gone
    saved = {name: S3Backend.__dict__[name] for name in MULTIPART_CALLS}
    patch_multipart_gone()
    yield
    for name, call in saved.items():
        setattr(S3Backend, name, call)


def test_parts_and_completions_for_a_completed_upload_are_no_such_upload(multipart_gone_patched: None) -> None:
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bucket")
        s3.put_object(Bucket="bucket", Key="source", Body=b"s" * 10)
        upload = s3.create_multipart_upload(Bucket="bucket", Key="shard")["UploadId"]
        etag = s3.upload_part(Bucket="bucket", Key="shard", UploadId=upload, PartNumber=1, Body=b"x")["ETag"]
        s3.complete_multipart_upload(Bucket="bucket", Key="shard", UploadId=upload,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
        late = [  # what a second sealer sends after the first completed the upload
            lambda: s3.upload_part(Bucket="bucket", Key="shard", UploadId=upload, PartNumber=1, Body=b"x"),
            lambda: s3.upload_part_copy(Bucket="bucket", Key="shard", UploadId=upload, PartNumber=1,
                                        CopySource={"Bucket": "bucket", "Key": "source"}),
        ]
        for call in late:
            with pytest.raises(ClientError) as gone:
                call()
            assert gone.value.response["Error"]["Code"] == "NoSuchUpload"
        # Completing it again is answered with the object, as S3 answers a retried completion.
        s3.complete_multipart_upload(Bucket="bucket", Key="shard", UploadId=upload,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
        assert s3.get_object(Bucket="bucket", Key="shard")["Body"].read() == b"x"
