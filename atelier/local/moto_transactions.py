"""DynamoDB's TransactWriteItems for moto's server: checked before anything is written, costing what it touches.

moto's TransactWriteItems deep-copies the whole table once per item of the transaction (to roll back), so
every claim and seal slowed down as the table grew. With DynamoDB requests serialised
(atelier/local/moto_server.py), the same all-or-nothing result needs no copy of the table: check every
condition first, then write, keeping only the touched items to restore if a write itself fails.
atelier/local/moto_shim.py installs it in place of moto's.
"""

from __future__ import annotations

import copy
from typing import Any

from moto.dynamodb.comparisons import get_filter_expression
from moto.dynamodb.exceptions import (ConditionalCheckFailed, MockValidationException, MultipleTransactionsException,
                                      TooManyTransactionsException, TransactionCanceledException,
                                      TransactWriteSingleOpException)
from moto.dynamodb.models import DynamoDBBackend

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
