"""DynamoDB items keyed by `pk`: reads, conditional writes, transactions, index queries and scans."""

from __future__ import annotations

import re
from typing import Any, Iterator

from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.exceptions import ClientError

from core.aws import clients
from core.aws.clients import error_code

_serializer = TypeSerializer()
_deserializer = TypeDeserializer()


def _to_item(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _serializer.serialize(v) for k, v in values.items() if v is not None}


def _from_item(item: dict[str, Any]) -> dict[str, Any]:
    return {k: _deserializer.deserialize(v) for k, v in item.items()}


def get_item(table: str, pk: str) -> dict[str, Any] | None:
    item = clients.client("dynamodb").get_item(TableName=table, Key=_to_item({"pk": pk}),
                                               ConsistentRead=True).get("Item")
    return _from_item(item) if item else None


def batch_get_items(table: str, pks: list[str], attributes: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Consistent reads of many items by `pk` (100 per request); absent items are left out."""
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(pks), 100):
        keys = [_to_item({"pk": pk}) for pk in dict.fromkeys(pks[start:start + 100])]
        request: dict[str, Any] = {table: {"Keys": keys, "ConsistentRead": True}}
        if attributes:
            request[table]["ProjectionExpression"] = ", ".join(f"#a{i}" for i in range(len(attributes)))
            request[table]["ExpressionAttributeNames"] = {f"#a{i}": a for i, a in enumerate(attributes)}
        while request:
            response = clients.client("dynamodb").batch_get_item(RequestItems=request)
            for item in response.get("Responses", {}).get(table, []):
                value = _from_item(item)
                found[value["pk"]] = value
            request = response.get("UnprocessedKeys") or {}
    return found


def put_item(table: str, item: dict[str, Any]) -> None:
    clients.client("dynamodb").put_item(TableName=table, Item=_to_item(item))


def put_item_if_absent(table: str, item: dict[str, Any]) -> bool:
    """Create-only write; False when an item with that key already exists."""
    try:
        clients.client("dynamodb").put_item(
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
        clients.client("dynamodb").update_item(**kwargs)
        return True
    except ClientError as exc:
        if error_code(exc) == "ConditionalCheckFailedException":
            return False
        raise


def _names_used(names: dict[str, str] | None, expression: str) -> dict[str, Any]:
    """DynamoDB refuses attribute names an expression does not use: pass each item only its own."""
    used = {k: v for k, v in (names or {}).items() if re.search(re.escape(k) + r"(?![A-Za-z0-9_])", expression)}
    return {"ExpressionAttributeNames": used} if used else {}


def transact_updates(table: str, updates: list[tuple[str, str, str, dict[str, Any]]],
                     puts: list[dict[str, Any]], names: dict[str, str] | None = None) -> bool:
    """All-or-nothing: conditional updates (pk, update, condition, values) and create-only puts.

    False when any condition fails (another invocation got there first).
    """
    items: list[dict[str, Any]] = [
        {"Update": {"TableName": table, "Key": _to_item({"pk": pk}), "UpdateExpression": update,
                    "ConditionExpression": condition, "ExpressionAttributeValues": _to_item(values),
                    **_names_used(names, update + " " + condition)}}
        for pk, update, condition, values in updates
    ]
    items += [
        {"Put": {"TableName": table, "Item": _to_item(item), "ConditionExpression": "attribute_not_exists(pk)"}}
        for item in puts
    ]
    try:
        clients.client("dynamodb").transact_write_items(TransactItems=items)
        return True
    except ClientError as exc:
        if error_code(exc) == "TransactionCanceledException":
            return False
        raise


def query_index(table: str, index: str, partition: str) -> list[dict[str, Any]]:
    """Every item of one GSI partition, in sort-key order."""
    paginator = clients.client("dynamodb").get_paginator("query")
    items: list[dict[str, Any]] = []
    for page in paginator.paginate(
        TableName=table, IndexName=index, KeyConditionExpression="gsi1pk = :p",
        ExpressionAttributeValues={":p": {"S": partition}},
    ):
        items.extend(_from_item(i) for i in page["Items"])
    return items


def scan(table: str, **filters: Any) -> Iterator[dict[str, Any]]:
    """Every item of the table (or those `filters` select), page by page."""
    for page in clients.client("dynamodb").get_paginator("scan").paginate(TableName=table, **filters):
        yield from (_from_item(i) for i in page["Items"])


def scan_prefix(table: str, prefix: str) -> list[dict[str, Any]]:
    return list(scan(table, FilterExpression="begins_with(pk, :p)", ExpressionAttributeValues={":p": {"S": prefix}}))
