"""The current recipe (contracts.recipe_file; docs/recipe.md): read and verified by the functions that decide
with it, checked and set by `atelier recipe set`.

The pointer is one item of the pipeline table (RECIPE_POINTER: uri, digest); the recipe itself lies at
`s3://<models bucket>/recipes/<digest>.json`, written once. Setting one is conditional on the digest the
operator read: two operators cannot overwrite each other's recipe unseen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from contracts import model_presets, recipe, serve_environment
from contracts.recipe_file import RECIPE_POINTER, Recipe, RecipeError, Stored, key, packaged, parse
from contracts.recipe_jobs import AutoencoderOptions, EvaluateOptions
from core import aws
from core.errors import ConfigError
from core.settings import flat_strings
from core.start_training.run_plan import PlannedJob, check_autoencoder_resolution, hyperparameters, parse_run_plan


class StaleRecipe(RecipeError):
    """The current recipe is no longer the one the change was made against."""


def current(table: str, models_bucket: str) -> Stored:
    """The recipe the functions decide with: the one the pointer names, its bytes checked against its digest;
    the packaged default while none was set."""
    pointer = aws.get_item(table, RECIPE_POINTER)
    if pointer is None:
        return packaged()
    digest = str(pointer["digest"])
    return Stored(recipe=parse(aws.read_object(models_bucket, key(digest)), expected_digest=digest),
                  uri=str(pointer["uri"]), digest=digest)


def with_current(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The function's environment (default: the process's) and the current recipe's values, by the names the
    settings read them (Stored.settings): what a decision is made with."""
    env = os.environ if env is None else env
    missing = [name for name in ("PIPELINE_TABLE", "MODELS_BUCKET") if not env.get(name, "").strip()]
    if missing:
        raise ConfigError(f"environment variable {missing[0]} is not set (template.yaml sets it)")
    return {**env, **current(env["PIPELINE_TABLE"].strip(), env["MODELS_BUCKET"].strip()).settings()}


def put(new: Recipe, table: str, models_bucket: str, expected_digest: str) -> Stored:
    """Check `new`, store it (create-only: its name is its digest) and move the pointer to it, on condition
    that the current recipe's digest is still `expected_digest` (the packaged default's while none was set)."""
    check(new)
    aws.write_object_if_absent(models_bucket, key(new.digest), new.canonical())
    uri = f"s3://{models_bucket}/{key(new.digest)}"
    values = {":u": uri, ":d": new.digest, ":t": datetime.now(timezone.utc).isoformat(), ":e": expected_digest}
    condition = "digest = :e"
    if expected_digest == packaged().digest:  # while none was set, the packaged default is current: no item
        condition += " OR attribute_not_exists(pk)"
    if not aws.update_item(table, RECIPE_POINTER, "SET uri = :u, digest = :d, set_at = :t, previous = :e", values,
                           condition=condition):
        now = current(table, models_bucket).digest
        raise StaleRecipe(f"the recipe changed since it was read: expected digest {expected_digest}, the current "
                          f"one is {now}; read it again (`atelier recipe show`) and set yours on top of it")
    return Stored(recipe=new, uri=uri, digest=new.digest)


def check(candidate: Recipe) -> None:
    """Every value parsed by the stage that reads it, as its settings parse it, without the deploy-time
    settings (quota, instance types, the base: the start-training function checks those when it starts):
    RecipeError naming the key."""
    try:
        _check(candidate)
    except ValueError as error:
        raise RecipeError(str(error)) from None


def _check(candidate: Recipe) -> None:
    training, evaluation = candidate.training, candidate.evaluation
    base = hyperparameters(flat_strings(training.hyperparameters, "training.hyperparameters"),
                           "training.hyperparameters")
    plan = parse_run_plan(json.dumps(training.run_plan), base, PlannedJob("main", "", 1, {}), "training.run_plan")
    for job in plan:
        # as if a base were set (PretrainedModelUri is deploy-time): a LoRA run is refused without one, at start
        for refusal in (model_presets.resolution_refusal(job.hyperparameters),
                        recipe.refusal(job.hyperparameters, added={"pretrained": "pretrained"})):
            if refusal:
                raise ValueError(f"training.run_plan job {job.name!r}: {refusal}")
    autoencoder = hyperparameters(flat_strings(training.autoencoder_hyperparameters,
                                               "training.autoencoder_hyperparameters"),
                                  "training.autoencoder_hyperparameters")
    if refusal := recipe.refusal(autoencoder, AutoencoderOptions):
        raise ValueError(f"training.autoencoder_hyperparameters: {refusal}")
    for job in plan:
        try:
            check_autoencoder_resolution(job, autoencoder)
        except ConfigError as error:
            raise ValueError(f"training.autoencoder_hyperparameters: {error}") from None
    scoring = hyperparameters(flat_strings(evaluation.hyperparameters, "evaluation.hyperparameters"),
                              "evaluation.hyperparameters")
    if refusal := recipe.refusal(scoring, EvaluateOptions):
        raise ValueError(f"evaluation.hyperparameters: {refusal}")
    # the candidate is the last run-plan job's model: the evaluation job refuses a resolution off its size multiple
    final = plan[-1].hyperparameters.get("model-config", model_presets.DEFAULT)
    if "resolution" in scoring and (refusal := model_presets.resolution_refusal({**scoring, "model-config": final})):
        raise ValueError(f"evaluation.hyperparameters: {refusal}")
    for name in ("max_loss", "max_loss_ratio", "min_clip_delta"):
        value = getattr(evaluation, name)
        if not 0 <= value < float("inf"):
            raise ValueError(f"evaluation.{name}={value} is outside 0.0..inf")
    serve_settings(candidate.serve.environment, "serve.environment")


def serve_settings(raw: Any, name: str) -> dict[str, str]:
    """The server's settings as a flat JSON object of its own $SERVE_* names, each value within SageMaker's limit
    and parsed as the model server parses it at start."""
    values = flat_strings(raw, name)
    if unknown := serve_environment.unknown(values):
        raise ValueError(f"{name}: {unknown} are not the model server's settings; "
                         f"it reads {', '.join(sorted(serve_environment.VARIABLES))}")
    if long := sorted(variable for variable, value in values.items() if len(value) > serve_environment.MAX_VALUE_CHARS):
        raise ValueError(f"{name}: {long} longer than SageMaker's {serve_environment.MAX_VALUE_CHARS} characters")
    try:
        serve_environment.ServeSettings.from_env(values)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    return values
