"""The only module that talks to boto3. Clients are made on first use, never at import.

Every client honours AWS_ENDPOINT_URL (and the per-service AWS_ENDPOINT_URL_<SERVICE>), so the
same code reaches real AWS or the local stack.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import boto3
from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.config import Config
from botocore.exceptions import ClientError

_RETRIES = Config(retries={"max_attempts": 5, "mode": "standard"})
_serializer = TypeSerializer()
_deserializer = TypeDeserializer()


@functools.cache
def client(service: str) -> Any:
    return boto3.client(service, config=_RETRIES)


def reset_clients() -> None:
    """Forget cached clients (tests change endpoints and credentials between cases)."""
    client.cache_clear()


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


# --- S3 -----------------------------------------------------------------------------------------

def head_object(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return client("s3").head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in {"404", "NoSuchKey", "NotFound"}:
            return None
        raise


def read_object(bucket: str, key: str, max_bytes: int | None = None) -> bytes:
    """Read an object; with `max_bytes`, never more than that many bytes (a ranged GET)."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if max_bytes is not None:
        kwargs["Range"] = f"bytes=0-{max_bytes - 1}"
    return client("s3").get_object(**kwargs)["Body"].read()


def read_json_if_exists(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise


def write_object(bucket: str, key: str, body: bytes, content_type: str = "application/octet-stream") -> None:
    client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)


# --- SQS and EventBridge -------------------------------------------------------------------------

def send_message(queue_url: str, body: str) -> None:
    client("sqs").send_message(QueueUrl=queue_url, MessageBody=body)


def put_event(bus: str, source: str, detail_type: str, detail: str) -> None:
    response = client("events").put_events(
        Entries=[{"EventBusName": bus, "Source": source, "DetailType": detail_type, "Detail": detail}]
    )
    if response.get("FailedEntryCount"):
        raise RuntimeError(f"EventBridge rejected the event: {response['Entries']}")


# --- DynamoDB -----------------------------------------------------------------------------------

def _to_item(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _serializer.serialize(v) for k, v in values.items() if v is not None}


def _from_item(item: dict[str, Any]) -> dict[str, Any]:
    return {k: _deserializer.deserialize(v) for k, v in item.items()}


def get_item(table: str, pk: str) -> dict[str, Any] | None:
    item = client("dynamodb").get_item(TableName=table, Key=_to_item({"pk": pk}), ConsistentRead=True).get("Item")
    return _from_item(item) if item else None


def put_item(table: str, item: dict[str, Any]) -> None:
    client("dynamodb").put_item(TableName=table, Item=_to_item(item))


def put_item_if_absent(table: str, item: dict[str, Any]) -> bool:
    """Create-only write; False when an item with that key already exists."""
    try:
        client("dynamodb").put_item(
            TableName=table, Item=_to_item(item), ConditionExpression="attribute_not_exists(pk)"
        )
        return True
    except ClientError as exc:
        if error_code(exc) == "ConditionalCheckFailedException":
            return False
        raise


def update_item(table: str, pk: str, update: str, values: dict[str, Any], condition: str | None = None,
                names: dict[str, str] | None = None) -> bool:
    """Update one item; False when `condition` does not hold."""
    kwargs: dict[str, Any] = {
        "TableName": table, "Key": _to_item({"pk": pk}), "UpdateExpression": update,
        "ExpressionAttributeValues": _to_item(values),
    }
    if condition:
        kwargs["ConditionExpression"] = condition
    if names:
        kwargs["ExpressionAttributeNames"] = names
    try:
        client("dynamodb").update_item(**kwargs)
        return True
    except ClientError as exc:
        if error_code(exc) == "ConditionalCheckFailedException":
            return False
        raise


def query_index(table: str, index: str, partition: str) -> list[dict[str, Any]]:
    """Every item of one GSI partition, in sort-key order."""
    paginator = client("dynamodb").get_paginator("query")
    items: list[dict[str, Any]] = []
    for page in paginator.paginate(
        TableName=table, IndexName=index, KeyConditionExpression="gsi1pk = :p",
        ExpressionAttributeValues={":p": {"S": partition}},
    ):
        items.extend(_from_item(i) for i in page["Items"])
    return items


def scan_prefix(table: str, prefix: str) -> list[dict[str, Any]]:
    paginator = client("dynamodb").get_paginator("scan")
    items: list[dict[str, Any]] = []
    for page in paginator.paginate(
        TableName=table, FilterExpression="begins_with(pk, :p)",
        ExpressionAttributeValues={":p": {"S": prefix}},
    ):
        items.extend(_from_item(i) for i in page["Items"])
    return items


def transact_updates(table: str, updates: list[tuple[str, str, str, dict[str, Any]]],
                     puts: list[dict[str, Any]], names: dict[str, str] | None = None) -> bool:
    """All-or-nothing: conditional updates (pk, update, condition, values) and create-only puts.

    False when any condition fails (another invocation got there first).
    """
    items: list[dict[str, Any]] = [
        {"Update": {"TableName": table, "Key": _to_item({"pk": pk}), "UpdateExpression": update,
                    "ConditionExpression": condition, "ExpressionAttributeValues": _to_item(values),
                    **({"ExpressionAttributeNames": names} if names else {})}}
        for pk, update, condition, values in updates
    ]
    items += [
        {"Put": {"TableName": table, "Item": _to_item(item), "ConditionExpression": "attribute_not_exists(pk)"}}
        for item in puts
    ]
    try:
        client("dynamodb").transact_write_items(TransactItems=items)
        return True
    except ClientError as exc:
        if error_code(exc) == "TransactionCanceledException":
            return False
        raise


# --- SageMaker ----------------------------------------------------------------------------------

def create_training_job(request: dict[str, Any]) -> bool:
    """Start a job; False when a job of that name exists already (a redelivered event)."""
    try:
        client("sagemaker").create_training_job(**request)
        return True
    except ClientError as exc:
        if error_code(exc) == "ResourceInUse":
            return False
        raise


def sagemaker_exists(kind: str, name: str) -> bool:
    """Whether a Model / EndpointConfig / Endpoint of that name exists."""
    describe = getattr(client("sagemaker"), f"describe_{kind}")
    try:
        describe(**{f"{''.join(p.title() for p in kind.split('_'))}Name": name})
        return True
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return False
        raise


def describe_endpoint(name: str) -> dict[str, Any] | None:
    try:
        return client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return None
        raise


def sagemaker_call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
    return getattr(client("sagemaker"), operation)(**request)
