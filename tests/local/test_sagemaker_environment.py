"""The Environment maps of CreateModel and CreateTrainingJob: the local SageMaker refuses what AWS refuses
(botocore's model gives the limits but checks neither maximum nor pattern before sending)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from atelier.local.sagemaker.shape_checks import check_shape
from atelier.local.sagemaker.validation import ApiError, sagemaker_model
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    FAKE_IMAGE,
    ROLE,
    aws,
    error_of,
    moto_url,
    overrides,
    service,
    sm,
    training_request,
)

KEY_PATTERN = "[a-zA-Z_][a-zA-Z0-9_]*"


def create_model(sm: Any, name: str, environment: Any) -> Callable[[], Any]:
    return lambda: sm.create_model(ModelName=name, ExecutionRoleArn=ROLE,
                                   PrimaryContainer={"Image": FAKE_IMAGE, "Environment": environment})


def create_training_job(sm: Any, name: str, environment: Any) -> Callable[[], Any]:
    return lambda: sm.create_training_job(**training_request(name, Environment=environment))


OPERATIONS = [pytest.param(create_model, "primaryContainer.environment", id="model"),
              pytest.param(create_training_job, "environment", id="training")]


@pytest.mark.parametrize("create, member", OPERATIONS)
@pytest.mark.parametrize("key", ["MY-VAR", "1ST", ""])
def test_a_key_outside_the_pattern_is_refused(sm: Any, create: Callable, member: str, key: str) -> None:
    code, message = error_of(create(sm, "bad-key", {"GOOD": "1", key: "x"}))

    assert (code, message) == ("ValidationException", f"1 validation error detected: Value at '{member}' failed to "
                               f"satisfy constraint: Map keys must satisfy constraint: [Member must satisfy regular "
                               f"expression pattern: {KEY_PATTERN}]")


@pytest.mark.parametrize("create, member", OPERATIONS)
def test_101_entries_are_refused_and_100_accepted(sm: Any, create: Callable, member: str) -> None:
    hundred = {f"VAR_{index}": "x" for index in range(100)}

    code, message = error_of(create(sm, "too-many", {**hundred, "ONE_MORE": "x"}))
    create(sm, "hundred", hundred)()

    assert code == "ValidationException" and f"'{member}'" in message
    assert "Member must have length less than or equal to 100" in message


def test_a_513_character_key_is_refused_for_training_but_accepted_for_a_model(sm: Any) -> None:
    environment = {"K" * 513: "x"}

    code, message = error_of(create_training_job(sm, "long-key", environment))
    create_model(sm, "long-key", environment)()

    assert (code, message) == ("ValidationException", "1 validation error detected: Value at 'environment' failed to "
                               "satisfy constraint: Map keys must satisfy constraint: [Member must have length less "
                               "than or equal to 512]")
    assert sm.describe_model(ModelName="long-key")["PrimaryContainer"]["Environment"] == environment


@pytest.mark.parametrize("create, member, limit", [
    pytest.param(create_model, "primaryContainer.environment", 1024, id="model"),
    pytest.param(create_training_job, "environment", 512, id="training")])
def test_a_value_over_its_limit_is_refused_and_one_at_it_accepted(sm: Any, create: Callable, member: str,
                                                                  limit: int) -> None:
    code, message = error_of(create(sm, "long-value", {"VALUE": "v" * (limit + 1)}))
    create(sm, "at-limit", {"VALUE": "v" * limit})()

    assert code == "ValidationException" and f"'{member}'" in message
    assert f"Map value must satisfy constraint: [Member must have length less than or equal to {limit}]" in message


def test_a_model_environment_over_32_kb_in_total_is_refused(sm: Any) -> None:
    # 32 entries of a 3-byte key and a 1021-byte value: 32768 bytes, each entry within its own limits
    at_limit = {f"K{index:02}": "v" * 1021 for index in range(32)}

    code, message = error_of(create_model(sm, "over-32kb", {**at_limit, "K00": "é" + "v" * 1020}))
    create_model(sm, "at-32kb", at_limit)()

    assert code == "ValidationException" and "'primaryContainer.environment'" in message
    assert "combined, is 32768 bytes; this map has 32769" in message
    assert [model["ModelName"] for model in sm.list_models()["Models"]] == ["at-32kb"]


@pytest.mark.parametrize("environment, expected", [(["A", "1"], "map"), ("A=1", "map"), ({"A": 1}, "string"),
                                                   ({1: "A"}, "string"), ({"A": None}, "string")])
def test_anything_but_a_map_of_strings_is_refused(environment: Any, expected: str) -> None:
    # botocore refuses these before sending; the local service must still not take them from another client.
    # AWS's JSON protocol fails a value of the wrong type in its deserializer, before any validation.
    shape = sagemaker_model().operation_model("CreateModel").input_shape
    with pytest.raises(ApiError) as caught:
        check_shape(shape, {"ModelName": "m", "PrimaryContainer": {"Image": FAKE_IMAGE, "Environment": environment}})

    assert (caught.value.code, caught.value.message) == (
        "SerializationException", f"Unexpected value type at 'primaryContainer.environment': expected {expected}")
