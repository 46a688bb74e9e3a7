"""The constraints of botocore's model that botocore leaves to the service: max, pattern, enum.

botocore checks a request's types, required members and minimums before sending it; SageMaker
checks the rest. `check_shape` walks a request along its operation's input shape and refuses it as
SageMaker does ("N validation errors detected: Value '...' at 'member.path' failed to satisfy
constraint: ..."), so the local stack refuses what AWS refuses. Pure: a shape and a dict in, an
ApiError out. It checks minimums too, for clients that skip botocore's validation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from botocore.model import Shape

from atelier.local.sagemaker.validation import validation_error

NUMBER_TYPES = ("integer", "long", "float", "double")
# Java-only regex syntax Python's `re` cannot compile; left unchecked here, with what covers them instead
# (tests/local/test_sagemaker_shapes.py notices when botocore's model changes the list).
SKIPPED_PATTERNS = {
    "TagKey": r"\p{L}\p{Z}\p{N}: tags.check_text checks these Unicode classes by hand",
    "TagValue": r"\p{L}\p{Z}\p{N}: tags.check_text checks these Unicode classes by hand",
    "TrainingRepositoryCredentialsProviderArn": r"\p{Alnum}: the pipeline sends no repository credentials",
}
# validation.check_environment checks these maps whole and, unlike this walk, leaves their values
# (possibly secrets) out of its messages.
HAND_CHECKED_SHAPES = frozenset({"EnvironmentMap", "TrainingEnvironmentMap"})

Violation = tuple[Any, str, str]  # (value, member path, constraint)


def check_shape(shape: Shape, request: dict[str, Any]) -> None:
    """Raise the ValidationException SageMaker gives a request that breaks its input shape's constraints."""
    found = list(violations(shape, request, ""))
    if found:
        count = len(found)
        raise validation_error(f"{count} validation error{'s' if count > 1 else ''} detected: " + "; ".join(
            f"Value '{java_text(value)}' at '{path}' failed to satisfy constraint: {constraint}"
            for value, path, constraint in found))


def violations(shape: Shape, value: Any, path: str) -> Iterator[Violation]:
    """Every broken constraint under `value`, in the model's member order. A value of the wrong type
    is passed over: botocore refuses those, and the handlers check what they read."""
    if value is None or shape.name in HAND_CHECKED_SHAPES:
        return
    if shape.type_name == "structure" and isinstance(value, dict):
        for name, member in shape.members.items():
            camel = name[0].lower() + name[1:]
            yield from violations(member, value.get(name), f"{path}.{camel}" if path else camel)
    elif shape.type_name == "list" and isinstance(value, list):
        yield from ((value, path, constraint) for constraint in _range(shape, len(value), "length"))
        for index, item in enumerate(value, start=1):
            yield from violations(shape.member, item, f"{path}.{index}.member")
    elif shape.type_name == "map" and isinstance(value, dict):
        # every map of the operations served here is string to string: its entries' constraints are scalars'
        yield from ((value, path, constraint) for constraint in _range(shape, len(value), "length"))
        for part, entry, items in (("Map keys", shape.key, value), ("Map value", shape.value, value.values())):
            broken = list(dict.fromkeys(c for item in items for c in scalar_violations(entry, item)))
            if broken:
                yield value, path, f"{part} must satisfy constraint: [{', '.join(broken)}]"
    else:
        yield from ((value, path, constraint) for constraint in scalar_violations(shape, value))


def scalar_violations(shape: Shape, value: Any) -> list[str]:
    """The constraints a string or number breaks."""
    if shape.type_name == "string" and isinstance(value, str):
        length = len(value.encode("utf-16-le")) // 2  # Java's String.length(): UTF-16 code units
        broken = list(_range(shape, length, "length"))
        pattern = shape.metadata.get("pattern")
        # AWS matches the whole value (Java's Matcher.matches); Java's \d \w \s are ASCII-only
        if pattern and shape.name not in SKIPPED_PATTERNS and not re.fullmatch(pattern, value, re.ASCII):
            broken.append(f"Member must satisfy regular expression pattern: {pattern}")
        if shape.enum and value not in shape.enum:
            broken.append(f"Member must satisfy enum value set: [{', '.join(shape.enum)}]")
        return broken
    if shape.type_name in NUMBER_TYPES and isinstance(value, (int, float)) and not isinstance(value, bool):
        return list(_range(shape, value, "value"))
    return []


def _range(shape: Shape, size: float, what: str) -> Iterator[str]:
    if "max" in shape.metadata and size > shape.metadata["max"]:
        yield f"Member must have {what} less than or equal to {shape.metadata['max']}"
    if "min" in shape.metadata and size < shape.metadata["min"]:
        yield f"Member must have {what} greater than or equal to {shape.metadata['min']}"


def java_text(value: Any) -> str:
    """A value as SageMaker's (Java) messages print it: lists [a, b], maps {k=v}."""
    if isinstance(value, list):
        return "[" + ", ".join(java_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}={java_text(item)}" for key, item in value.items()) + "}"
    return str(value)
