"""What every stage's settings share: a pydantic model parsed once from the function's environment.

Each stage package has its own settings model (core/ingest/settings.py, core/pack/settings.py, ...), one
field per environment variable, named by its `validation_alias`. A setting is one of two kinds, and has
one default at most:
- a deploy-time choice: template.yaml passes it from a parameter, whose Default is its only default, so
  the field has none (missing or empty is a ConfigError naming the variable);
- a tuning knob: template.yaml passes nothing and the field's default applies, unless its variable is set
  (tests set some; so may `sam local invoke --env-vars`).
Pydantic dataclasses validated from a mapping, not pydantic-settings' BaseSettings: a BaseSettings reads
os.environ whenever it is built, direct construction included (a test's settings would pick up whatever
the process has set); several settings are assembled from more than one variable (the run plan from
TRAINING_HYPERPARAMETERS and TRAINING_RUN_PLAN, the decode policy from five), which its per-field
environment source cannot hand a validator; and a dataclass keeps `dataclasses.replace`, which the
handlers and tests use to vary one setting. Parsing, ranges and messages are pydantic's either way.
This module imports no stage module: the stages import it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Self, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs

from contracts import recipe_file
from core.errors import ConfigError


CONFIG = ConfigDict(validate_by_name=True, validate_by_alias=True, extra="ignore", allow_inf_nan=False)
T = TypeVar("T")


def settings(cls: type[T]) -> type[T]:
    """A stage's settings class: a frozen pydantic dataclass, its fields read by their aliases."""
    return dataclass(frozen=True, kw_only=True, config=CONFIG)(cls)


def given(values: Any) -> Any:
    """What a `mode="before"` validator of a settings dataclass is handed, as a dict when it is one."""
    if isinstance(values, ArgsKwargs):
        return dict(values.kwargs or {})
    return dict(values) if isinstance(values, dict) else values


class StageSettings:
    """A stage's settings (subclasses are @settings): read from the environment by alias, errors as
    ConfigError naming the variable."""

    # variables that mean "none" when empty (the template joins empty lists to ""); the others count as missing
    optional: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        """The settings from `env` (default: the process environment)."""
        values = {k: v for k, v in (os.environ if env is None else env).items()
                  if not isinstance(v, str) or v.strip() or k in cls.optional}
        try:
            parsed = TypeAdapter(cls).validate_python({k: v.strip() if isinstance(v, str) else v for k, v in values.items()})
        except ValidationError as error:
            raise ConfigError(describe(cls, error)) from None
        parsed.check()
        return parsed

    def check(self) -> None:
        """What holds across settings, checked once they are read from the environment (not when a test or a
        handler varies one with dataclasses.replace)."""


def describe(cls: type, error: ValidationError) -> str:
    """The first error of a validation, in the words of the variable it is about."""
    first = error.errors(include_url=False)[0]
    if not first["loc"] and first["type"] == "value_error":  # a model validator's, which names its variables
        return str(first.get("ctx", {}).get("error", first["msg"]))
    name = str(first["loc"][0]) if first["loc"] else cls.__name__
    fields = getattr(cls, "__pydantic_fields__", {})
    field = next((f for f in fields.values() if f.validation_alias == name), None)
    value = first.get("input")
    kind, context = first["type"], first.get("ctx", {})
    if kind == "missing" and name in recipe_file.SETTINGS:
        return f"{name} is not set (the recipe gives it: the settings' `current`, core/recipes.py)"
    if kind == "missing":
        return f"environment variable {name} is not set (template.yaml sets it)"
    if kind in {"int_parsing", "int_from_float"}:
        return f"{name}={value!r} is not an integer"
    if kind == "float_parsing":
        return f"{name}={value!r} is not a number"
    if kind == "finite_number":
        return f"{name}={value!r} is not a finite number"
    if kind in {"greater_than_equal", "less_than_equal", "greater_than", "less_than"} and field is not None:
        low = next((m.ge for m in field.metadata if hasattr(m, "ge")), -math.inf)
        high = next((m.le for m in field.metadata if hasattr(m, "le")), math.inf)
        return f"{name}={value} is outside {low}..{high}"
    if kind == "literal_error":
        return f"{name}={value!r} is not one of ({context.get('expected', '')})"
    if kind == "value_error":  # a validator's own message, which names its variable where it can
        text = str(context.get("error", first["msg"]))
        return text if text.startswith(name) else f"{name}: {text}"
    return f"{name}={value!r}: {first['msg']}"


def names(raw: str) -> tuple[str, ...]:
    """A comma-separated list, its items stripped, empty ones dropped."""
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def flat_strings(raw: str | Mapping[str, Any], name: str) -> dict[str, str]:
    """A flat JSON object, its values as strings; anything else refused early."""
    if isinstance(raw, Mapping):
        value: Any = dict(raw)
    else:
        try:
            value = json.loads(raw or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    nested = sorted(k for k, v in value.items() if isinstance(v, (dict, list)))
    if nested:
        raise ValueError(f"{name} must be flat; {nested} hold objects or lists")
    return {str(k): str(v) for k, v in value.items()}
