"""The local stack's recipe: the packaged default with the changes of recipes/<config env>.toml and of the
stack's options (tests, the demo), set once the stack is up, before any function runs (docs/recipe.md)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts.recipe_file import Stored, packaged
from core import recipes

Changes = Mapping[str, Mapping[str, Any]]  # section -> field -> value, each replacing the default's whole


def file_changes(root: Path, config_env: str) -> dict[str, dict[str, Any]]:
    """recipes/<config env>.toml's changes ({} without the file)."""
    path = root / "recipes" / f"{config_env}.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def combined(*changes: Changes) -> dict[str, dict[str, Any]]:
    """Changes applied in turn: a later one's field replaces an earlier one's."""
    result: dict[str, dict[str, Any]] = {}
    for change in changes:
        for section, fields in change.items():
            result.setdefault(section, {}).update(fields)
    return result


def set_local(outputs: Mapping[str, str], changes: Changes) -> Stored:
    """The packaged default with `changes`, checked and set as the stack's current recipe (over whichever was)."""
    table, bucket = outputs["PipelineTableName"], outputs["ModelsBucketName"]
    return recipes.put(packaged().recipe.changed(changes), table, bucket,
                       expected_digest=recipes.current(table, bucket).digest)
