"""The recipe file: what the pipeline trains, how it judges a model and how it serves one, versioned and
named by its digest (docs/recipe.md).

One JSON document, `Recipe`: the training jobs' hyperparameters, the run plan and the autoencoder job's
hyperparameters; the evaluation job's hyperparameters, the gate's thresholds and the CLIP model; the model
server's environment. Stored content-addressed and immutable at `s3://<models bucket>/recipes/<sha256>.json`
(the sha256 of its canonical bytes: sorted keys, no spaces), the current one named by one item of the
pipeline table (RECIPE_POINTER: its uri and digest). The repository ships the default (default_recipe.json,
what the template's parameters said before the recipe left it), which applies until a recipe is set.

This module holds the file's shape (a key the recipe does not know is refused, named) and its identity;
what each value may be is checked by the stages' own parsers, the ones their settings read it with
(core.recipes.check: the trainer's options, SageMaker's limits, the model server's settings).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

VERSION = 1  # the schema's; a file of another version is refused, never read as this one
DEFAULT_FILE = Path(__file__).with_name("default_recipe.json")
PACKAGED_URI = "package:contracts/default_recipe.json"  # the uri recorded while no recipe was ever set
RECIPES = "recipes/"  # in the models bucket: <sha256>.json (contracts.s3_layout's prefixes are the buckets' layout)
RECIPE_POINTER = "RECIPE#current"  # the pipeline table's item naming the current recipe: uri, digest, set_at


# the names the recipe's values reach the stages' settings by (Recipe.settings, Stored.settings)
SETTINGS = ("TRAINING_HYPERPARAMETERS", "TRAINING_RUN_PLAN", "TRAINING_AUTOENCODER_HYPERPARAMETERS",
            "EVAL_HYPERPARAMETERS", "GATE_MAX_LOSS", "GATE_MAX_LOSS_RATIO", "GATE_MIN_CLIP_DELTA", "CLIP_MODEL_URI",
            "SERVE_ENVIRONMENT", "RECIPE_URI", "RECIPE_DIGEST")


class RecipeError(ValueError):
    """A recipe that cannot be used: its message names the key or the value, as `atelier recipe set` prints it."""


class DigestMismatch(RecipeError):
    """A stored recipe whose bytes are not the ones its name (its digest) promises."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Training(_Section):
    # trainer/jobs/train.py's hyperparameters (SageMaker strings), every run-plan job's starting point
    hyperparameters: dict[str, Any]
    # one training job each, chained: [{"name", "instance_type"?, "instance_count"?, "hyperparameters"?}];
    # []: one job with the hyperparameters above (core.start_training.run_plan)
    run_plan: list[dict[str, Any]] = Field(default_factory=list)
    # trainer/jobs/autoencoder.py's, besides what it takes from the training job (contracts.recipe_jobs)
    autoencoder_hyperparameters: dict[str, Any] = Field(default_factory=dict)


class Evaluation(_Section):
    hyperparameters: dict[str, Any] = Field(default_factory=dict)  # trainer/jobs/evaluate.py's
    max_loss: float  # the gate (core.deploy.gate): a candidate above this validation loss is never served
    max_loss_ratio: float  # ... nor one whose loss over production's is above this
    min_clip_delta: float  # ... nor one whose CLIP score trails production's by more than this
    clip_model_uri: str = ""  # s3:// prefix of a CLIP model (save_pretrained) for the CLIP score; empty: none


class Serve(_Section):
    environment: dict[str, Any] = Field(default_factory=dict)  # the model server's $SERVE_* settings


class Recipe(_Section):
    version: Literal[1]
    training: Training
    evaluation: Evaluation
    serve: Serve

    def canonical(self) -> bytes:
        """The bytes the digest is of, and the stored file's: sorted keys, no insignificant spaces."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    def changed(self, changes: Mapping[str, Mapping[str, Any]]) -> "Recipe":
        """This recipe with fields of its sections replaced whole, e.g. {"training": {"run_plan": []}} (how the
        local stack and the tests vary it, as a template parameter override replaced a parameter)."""
        data = self.model_dump(mode="json")
        for section, fields in changes.items():
            if not isinstance(data.get(section), dict) or not isinstance(fields, Mapping):
                raise RecipeError(f"recipe change {section!r}: not a section of the recipe (training, evaluation, serve)")
            data[section].update(fields)
        return validated(data)

    def settings(self) -> dict[str, str]:
        """The recipe's values by the names the stages' settings read them (core/start_training/settings.py,
        core/deploy/settings.py), as the template's parameters passed them before."""
        training, evaluation = self.training, self.evaluation
        return {"TRAINING_HYPERPARAMETERS": json.dumps(training.hyperparameters),
                "TRAINING_RUN_PLAN": json.dumps(training.run_plan),
                "TRAINING_AUTOENCODER_HYPERPARAMETERS": json.dumps(training.autoencoder_hyperparameters),
                "EVAL_HYPERPARAMETERS": json.dumps(evaluation.hyperparameters),
                "GATE_MAX_LOSS": repr(evaluation.max_loss), "GATE_MAX_LOSS_RATIO": repr(evaluation.max_loss_ratio),
                "GATE_MIN_CLIP_DELTA": repr(evaluation.min_clip_delta), "CLIP_MODEL_URI": evaluation.clip_model_uri,
                "SERVE_ENVIRONMENT": json.dumps(self.serve.environment)}


class Stored(BaseModel):
    """A recipe and where it was read from: its uri (s3://..., or PACKAGED_URI) and its digest."""

    model_config = ConfigDict(frozen=True)
    recipe: Recipe
    uri: str
    digest: str

    def settings(self) -> dict[str, str]:
        """The recipe's values for the settings, and which recipe they are (RECIPE_URI, RECIPE_DIGEST)."""
        return {**self.recipe.settings(), "RECIPE_URI": self.uri, "RECIPE_DIGEST": self.digest}


def key(digest: str) -> str:
    """Its key in the models bucket: content-addressed, so a stored recipe never changes."""
    return f"{RECIPES}{digest}.json"


def describe(error: ValidationError) -> str:
    """A validation error as one line naming the key (training.run_plan[0], serve.environment, ...)."""
    first = error.errors(include_url=False)[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    if first["type"] == "extra_forbidden":
        return f"{where}: not a key of the recipe (version {VERSION}); known: {_known(first['loc'][:-1])}"
    if first["type"] == "literal_error" and first["loc"] == ("version",):
        return f"version {first['input']!r}: this pipeline reads recipe version {VERSION}"
    return f"{where or 'recipe'}: {first['msg']}"


def _known(loc: tuple) -> str:
    model: Any = Recipe
    for part in loc:
        model = model.model_fields[part].annotation if isinstance(part, str) else model
    return ", ".join(sorted(model.model_fields)) if isinstance(model, type) and issubclass(model, BaseModel) else "none"


def validated(data: Any) -> Recipe:
    """A recipe from parsed JSON; RecipeError naming what is wrong."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise RecipeError(describe(error)) from None


def parse(raw: bytes | str, expected_digest: str | None = None) -> Recipe:
    """A recipe from a file's bytes; with `expected_digest`, DigestMismatch unless those bytes are that recipe's."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecipeError(f"a recipe is a JSON object: {error}") from None
    recipe = validated(data)
    if expected_digest is not None:
        actual = hashlib.sha256(raw.encode() if isinstance(raw, str) else raw).hexdigest()
        if actual != expected_digest or recipe.digest != expected_digest:
            raise DigestMismatch(f"recipe {key(expected_digest)} has digest {actual}, not {expected_digest}: "
                                 "the stored recipe was changed; set it again (`atelier recipe set`)")
    return recipe


def packaged() -> Stored:
    """The repository's default recipe, which applies while none was set."""
    recipe = parse(DEFAULT_FILE.read_bytes())
    return Stored(recipe=recipe, uri=PACKAGED_URI, digest=recipe.digest)
