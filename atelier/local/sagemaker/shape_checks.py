"""Every request against botocore's model of its operation: types, required members, min, max, pattern, enum.

botocore checks a request's types, required members and minimums before sending it; SageMaker
checks them again, and the rest. `check_shape` walks a request along its operation's input shape
and refuses it as the service does: a value of the wrong type is a SerializationException (AWS's
JSON protocols fail those in the deserializer, before validation); every other broken constraint is
listed in one ValidationException ("N validation errors detected: Value '...' at 'member.path'
failed to satisfy constraint: ..."). Pure: a shape and a dict in, an ApiError out.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator
from typing import Any

from botocore.model import Shape

from atelier.local.sagemaker.validation import ApiError, validation_error

NUMBER_TYPES = ("integer", "long", "float", "double")
PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "structure": dict, "map": dict, "list": list, "string": str, "boolean": bool, "integer": int, "long": int,
    "float": (int, float), "double": (int, float), "timestamp": (int, float, str)}  # JSON timestamps: epoch seconds


def _tag_text(value: str) -> bool:
    # [\p{L}\p{Z}\p{N}_.:/=+\-@]*: Unicode letters, separators and numbers, and those symbols
    return all(c in "_.:/=+-@" or unicodedata.category(c)[0] in "LZN" for c in value)


# Java-only regex syntax Python's `re` cannot compile: each with what stands in for it, or None, unchecked
# (tests/local/test_sagemaker_shapes.py notices when botocore's model changes the list).
SKIPPED_PATTERNS: dict[str, Callable[[str], bool] | None] = {
    "TagKey": _tag_text, "TagValue": _tag_text,
    "TrainingRepositoryCredentialsProviderArn": None,  # the pipeline sends no repository credentials
}
# Containers' Environment maps: their values may be secrets, so messages leave the value out (as Lambda's do).
SECRET_SHAPES = frozenset({"EnvironmentMap", "TrainingEnvironmentMap"})
HIDDEN = object()

Violation = tuple[Any, str, str]  # (value, member path, constraint)


def check_shape(shape: Shape, request: dict[str, Any]) -> None:
    """Raise the error SageMaker gives a request that breaks its input shape."""
    wrong = next(wrong_types(shape, request, ""), None)
    if wrong:
        raise ApiError("SerializationException", f"Unexpected value type at '{wrong[0] or 'request'}': expected "
                                                 f"{wrong[1]}")
    found = list(violations(shape, request, ""))
    if found:
        count = len(found)
        raise validation_error(f"{count} validation error{'s' if count > 1 else ''} detected: " + "; ".join(
            f"Value {shown(value)}at '{path}' failed to satisfy constraint: {constraint}"
            for value, path, constraint in found))


def wrong_types(shape: Shape, value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(member path, expected type) of every value whose JSON type is not its shape's."""
    if value is None:
        return
    expected = PYTHON_TYPES.get(shape.type_name, object)
    if not isinstance(value, expected) or (isinstance(value, bool) and shape.type_name != "boolean"):
        yield path, shape.type_name
    elif shape.type_name == "structure":
        for name, member in shape.members.items():
            yield from wrong_types(member, value.get(name), _join(path, name))
    elif shape.type_name == "list":
        for index, item in enumerate(value, start=1):
            yield from wrong_types(shape.member, item, f"{path}.{index}.member")
    elif shape.type_name == "map":
        for key, item in value.items():
            if item is None:  # a map holds no nulls
                yield path, shape.value.type_name
            yield from wrong_types(shape.key, key, path)
            yield from wrong_types(shape.value, item, path)


def violations(shape: Shape, value: Any, path: str) -> Iterator[Violation]:
    """Every broken constraint under `value` (types already checked), in the model's member order."""
    if shape.type_name == "structure":
        for name, member in shape.members.items():
            if value.get(name) is None:
                if name in shape.required_members:
                    yield None, _join(path, name), "Member must not be null"
                continue
            yield from violations(member, value[name], _join(path, name))
    elif shape.type_name == "list":
        yield from ((value, path, constraint) for constraint in _range(shape, len(value), "length"))
        for index, item in enumerate(value, start=1):
            if item is not None:
                yield from violations(shape.member, item, f"{path}.{index}.member")
    elif shape.type_name == "map":
        # every map of the operations served here is string to string: its entries' constraints are scalars'
        entire = HIDDEN if shape.name in SECRET_SHAPES else value
        yield from ((entire, path, constraint) for constraint in _range(shape, len(value), "length"))
        for part, entry, items in (("Map keys", shape.key, value), ("Map value", shape.value, value.values())):
            broken = list(dict.fromkeys(c for item in items if item is not None for c in scalar_violations(entry, item)))
            if broken:
                yield entire, path, f"{part} must satisfy constraint: [{', '.join(broken)}]"
    else:
        yield from ((value, path, constraint) for constraint in scalar_violations(shape, value))


def scalar_violations(shape: Shape, value: Any) -> list[str]:
    """The constraints a string or number breaks."""
    if shape.type_name == "string":
        length = len(value.encode("utf-16-le")) // 2  # Java's String.length(): UTF-16 code units
        broken = list(_range(shape, length, "length"))
        pattern = shape.metadata.get("pattern")
        # AWS matches the whole value (Java's Matcher.matches); Java's \d \w \s are ASCII-only
        stand_in = SKIPPED_PATTERNS.get(shape.name, lambda text: re.fullmatch(pattern, text, re.ASCII))
        if pattern and stand_in and not stand_in(value):
            broken.append(f"Member must satisfy regular expression pattern: {pattern}")
        if shape.enum and value not in shape.enum:
            broken.append(f"Member must satisfy enum value set: [{', '.join(shape.enum)}]")
        return broken
    if shape.type_name in NUMBER_TYPES:
        return list(_range(shape, value, "value"))
    return []


def _range(shape: Shape, size: float, what: str) -> Iterator[str]:
    if "max" in shape.metadata and size > shape.metadata["max"]:
        yield f"Member must have {what} less than or equal to {shape.metadata['max']}"
    if "min" in shape.metadata and size < shape.metadata["min"]:
        yield f"Member must have {what} greater than or equal to {shape.metadata['min']}"


def _join(path: str, member: str) -> str:
    camel = member[0].lower() + member[1:]
    return f"{path}.{camel}" if path else camel


def shown(value: Any) -> str:
    """A value as SageMaker's (Java) messages print it: null, 'text', '[a, b]', '{k=v}'; a secret map not at all."""
    if value is HIDDEN:
        return ""
    return "null " if value is None else f"'{java_text(value)}' "


def java_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(java_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}={java_text(item)}" for key, item in value.items()) + "}"
    return str(value)
