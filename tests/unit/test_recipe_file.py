"""The recipe file (contracts/recipe_file.py): its shape, its identity, and that the packaged default is what the
template's parameters said before the recipe left it, so a stack deployed without a recipe behaves as before."""

from __future__ import annotations

import json
import re

import pytest

from contracts.recipe_file import DigestMismatch, RecipeError, key, packaged, parse, validated
from core import recipes
from tests.unit.template_helpers import expand_with

# template.yaml's defaults of the parameters the recipe replaced (as of cfc09dc), verbatim
TEMPLATE_DEFAULTS = {
    "TrainingHyperparameters": '{"steps": "100000", "batch-size": "32", "resolution": "256", "learning-rate": "0.0001", '
                               '"checkpoint-every": "1000", "seed": "0", "model-config": "sd2"}',
    "TrainingRunPlan": '[{"name": "256", "hyperparameters": {"resolution": "256", "batch-size": "256", "steps": "200000", '
                       '"lr-warmup-steps": "10000"}}, {"name": "512", "hyperparameters": {"resolution": "512", '
                       '"batch-size": "64", "gradient-accumulation": "2", "steps": "100000", "lr-warmup-steps": "1000"}}, '
                       '{"name": "1024", "hyperparameters": {"resolution": "1024", "batch-size": "8", "steps": "50000", '
                       '"learning-rate": "0.00005", "lr-warmup-steps": "1000"}}]',
    "AutoencoderHyperparameters": '{"steps": "20000", "batch-size": "32", "learning-rate": "0.0001"}',
    "EvalHyperparameters": '{"timesteps": "100,300,500,700,900", "seed": "0", "max_samples": "64"}',
    "GateMaxLoss": "1.0", "GateMaxLossRatio": "1.05", "GateMinClipDelta": "0.5", "ClipModelUri": "",
    "ServeEnvironment": "{}",
}
SETTING = {"TrainingHyperparameters": "TRAINING_HYPERPARAMETERS", "TrainingRunPlan": "TRAINING_RUN_PLAN",
           "AutoencoderHyperparameters": "TRAINING_AUTOENCODER_HYPERPARAMETERS",
           "EvalHyperparameters": "EVAL_HYPERPARAMETERS", "GateMaxLoss": "GATE_MAX_LOSS",
           "GateMaxLossRatio": "GATE_MAX_LOSS_RATIO", "GateMinClipDelta": "GATE_MIN_CLIP_DELTA",
           "ClipModelUri": "CLIP_MODEL_URI", "ServeEnvironment": "SERVE_ENVIRONMENT"}


def document() -> dict:
    return packaged().recipe.model_dump(mode="json")


def test_the_packaged_recipe_gives_the_settings_what_the_template_s_defaults_gave() -> None:
    assert packaged().recipe.settings() == {SETTING[name]: value for name, value in TEMPLATE_DEFAULTS.items()}


def test_the_recipe_s_parameters_are_gone_from_the_template_and_it_keeps_about_twenty() -> None:
    parameters = expand_with({}).parameters

    assert not set(TEMPLATE_DEFAULTS) & set(parameters)
    assert len([name for name in parameters if "::" not in name]) <= 33  # was 76 (docs/recipe.md: what stays, by kind)


def test_a_recipe_round_trips_through_its_canonical_bytes_with_the_same_digest() -> None:
    recipe = packaged().recipe

    again = parse(recipe.canonical(), expected_digest=recipe.digest)

    assert again == recipe and again.digest == recipe.digest
    assert recipe.canonical() == json.dumps(document(), sort_keys=True, separators=(",", ":")).encode()


def test_the_digest_is_of_the_content_not_of_its_layout() -> None:
    spaced = json.dumps(document(), indent=4).encode()  # another layout, key order as written

    assert parse(spaced).digest == packaged().digest == packaged().recipe.changed({}).digest
    assert re.fullmatch(r"[0-9a-f]{64}", packaged().digest) and key(packaged().digest) == f"recipes/{packaged().digest}.json"


def test_a_change_replaces_a_field_whole_and_makes_another_digest() -> None:
    changed = packaged().recipe.changed({"training": {"run_plan": []}, "evaluation": {"max_loss": 2.0}})

    assert changed.training.run_plan == [] and changed.evaluation.max_loss == 2.0
    assert changed.training.hyperparameters == packaged().recipe.training.hyperparameters
    assert changed.digest != packaged().digest


@pytest.mark.parametrize(("edit", "message"), [
    pytest.param(lambda d: d["training"].update(learning_rate="1e-4"),
                 "training.learning_rate: not a key of the recipe (version 1); known: autoencoder_hyperparameters, "
                 "hyperparameters, run_plan", id="unknown-training-key"),
    pytest.param(lambda d: d.update(gate={}),
                 "gate: not a key of the recipe (version 1); known: evaluation, serve, training, version",
                 id="unknown-section"),
    pytest.param(lambda d: d.update(version=2), "version 2: this pipeline reads recipe version 1", id="version"),
    pytest.param(lambda d: d["evaluation"].pop("max_loss"), "evaluation.max_loss: Field required", id="missing"),
])
def test_a_recipe_of_another_shape_is_refused_naming_the_key(edit, message: str) -> None:
    data = document()
    edit(data)

    with pytest.raises(RecipeError) as refused:
        validated(data)

    assert str(refused.value) == message


def test_bytes_that_are_not_the_named_recipe_are_a_digest_mismatch() -> None:
    digest = packaged().digest
    tampered = json.dumps({**document(), "evaluation": {**document()["evaluation"], "max_loss": 9.0}},
                          sort_keys=True, separators=(",", ":")).encode()

    with pytest.raises(DigestMismatch, match=f"recipe recipes/{digest}.json has digest [0-9a-f]{{64}}, not {digest}"):
        parse(tampered, expected_digest=digest)


@pytest.mark.parametrize(("changes", "message"), [
    pytest.param({"training": {"hyperparameters": {"lerning-rate": "1e-4"}}},
                 "training.run_plan job '256': hyperparameter 'lerning-rate' is not an option of the job "
                 "(did you mean 'learning-rate'?)", id="trainer-refuses"),
    pytest.param({"training": {"run_plan": [{"hyperparameters": {}}]}}, "training.run_plan[0] needs a name",
                 id="plan-without-name"),
    pytest.param({"training": {"hyperparameters": {"betas": [0.9, 0.999]}}},
                 "training.hyperparameters must be flat; ['betas'] hold objects or lists", id="not-flat"),
    pytest.param({"training": {"autoencoder_hyperparameters": {"kl-weigth": "1e-6"}}},
                 "training.autoencoder_hyperparameters: hyperparameter 'kl-weigth' is not an option of the job "
                 "(did you mean 'kl-weight'?)", id="autoencoder"),
    pytest.param({"training": {"autoencoder_hyperparameters": {"resolution": "252"}}},
                 "training.autoencoder_hyperparameters: run-plan job '256''s autoencoder job: resolution '252' must be a "
                 "whole number of pixels, a multiple of 8 (model-config 'sd2': its VAE's downsampling)",
                 id="autoencoder-resolution"),
    pytest.param({"evaluation": {"hyperparameters": {"timesteps": "100,100", "seed": "0", "max_samples": "64"}}},
                 "evaluation.hyperparameters: timesteps '100,100': timesteps are distinct non-negative integers, "
                 "comma-separated", id="evaluation"),
    pytest.param({"evaluation": {"hyperparameters": {"resolution": "520"}}},
                 "evaluation.hyperparameters: resolution '520' must be a whole number of pixels, a multiple of 64 "
                 "(model-config 'sd2'", id="evaluation-resolution"),  # the last run-plan job's preset
    pytest.param({"evaluation": {"max_loss": -1.0}}, "evaluation.max_loss=-1.0 is outside 0.0..inf", id="gate"),
    pytest.param({"serve": {"environment": {"SERVE_COMPLE": "off"}}},
                 "serve.environment: ['SERVE_COMPLE'] are not the model server's settings; it reads", id="serve"),
])
def test_a_value_a_stage_would_refuse_is_refused_in_its_words(changes: dict, message: str) -> None:
    with pytest.raises(RecipeError) as refused:
        recipes.check(packaged().recipe.changed(changes))

    assert str(refused.value).startswith(message)


def test_the_packaged_recipe_passes_every_check() -> None:
    recipes.check(packaged().recipe)
