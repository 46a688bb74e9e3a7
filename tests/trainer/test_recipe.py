"""The training recipe (functions/contracts/recipe.py, recipe_jobs.py) and the jobs' parsers agree: every option
a job takes has a recipe field and every field is an option, with the field's default; the start-training
function refuses what the trainer would, with the trainer's own message."""

from __future__ import annotations

import argparse
import json

import pytest

from contracts import recipe
from contracts.recipe import Phase, TrainOptions, dest
from contracts.recipe_jobs import (AUTOENCODER_PATHS, ENCODE_PATHS, EVALUATE_PATHS, TOKENIZER_PATHS, AutoencoderOptions,
                                   EncodeOptions, EvaluateOptions, TokenizerOptions)
from tests.support import REPO
from trainer.jobs import autoencoder, encode, evaluate, tokenizer, train_args
from trainer.jobs.hyperparameters import add_options

JOBS = [pytest.param(train_args.parse_args, TrainOptions, recipe.TRAIN_PATHS, ["--train-dir", "t", "--model-dir", "m"],
                     id="train"),
        pytest.param(encode.parse_args, EncodeOptions, ENCODE_PATHS, ["--train-dir", "t", "--output-dir", "o"],
                     id="encode"),
        pytest.param(autoencoder.parse_args, AutoencoderOptions, AUTOENCODER_PATHS, ["--train-dir", "t", "--model-dir",
                     "m"], id="autoencoder"),
        pytest.param(tokenizer.parse_args, TokenizerOptions, TOKENIZER_PATHS, ["--train-dir", "t", "--model-dir", "m"],
                     id="tokenizer"),
        pytest.param(evaluate.parse_args, EvaluateOptions, EVALUATE_PATHS, ["--model-dir", "m"], id="evaluate")]


class Built(Exception):
    """Raised instead of parsing, with the parser a job built."""


def options_of(parse, monkeypatch) -> set[str]:
    """The flags a job's parser takes (its --help aside), read from the parser that `parse` builds."""
    def caught(parser, argv=None, namespace=None):
        raise Built(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(Built) as built:
        parse([])
    monkeypatch.undo()
    return {option.removeprefix("--") for action in built.value.args[0]._actions for option in action.option_strings
            if option.startswith("--") and action.dest != "help"}


@pytest.mark.parametrize("parse, options, paths, argv", JOBS)
def test_every_option_of_a_job_is_a_recipe_field_and_every_field_an_option(parse, options, paths, argv, monkeypatch):
    flags = options_of(parse, monkeypatch)

    assert flags - set(paths) == options.flags()  # an option the recipe lacks, or a field no flag reads
    assert set(paths) <= flags and not set(paths) & options.flags()  # the container's paths are not recipe fields


@pytest.mark.parametrize("parse, options, paths, argv", JOBS)
def test_a_job_s_defaults_are_its_recipe_s(parse, options, paths, argv, monkeypatch):
    monkeypatch.delenv("SM_HPS", raising=False)
    args = parse(argv)

    assert {dest(f): getattr(args, dest(f)) for f in options.model_fields.values()} == \
        {dest(f): f.default for f in options.model_fields.values()}


def test_a_flag_the_recipe_lacks_is_caught():
    class Fewer(recipe.Options):
        seed: int = recipe.option(0, "seed")

    parser = argparse.ArgumentParser()
    add_options(parser, Fewer)
    parser.add_argument("--by-hand")
    flags = {o.removeprefix("--") for a in parser._actions for o in a.option_strings if a.dest != "help"}

    assert flags - Fewer.flags() == {"by-hand"}


@pytest.mark.parametrize("options", [EncodeOptions, AutoencoderOptions, TokenizerOptions])
def test_what_a_helper_job_takes_from_its_stage_is_typed_as_the_training_option(options):
    shared = options.training_job_flags()
    train = {field.alias: field for field in TrainOptions.model_fields.values()}

    assert shared and set(shared) <= set(train)
    assert {name: str(train[name].annotation) for name in shared} == \
        {f.alias: str(f.annotation) for f in options.model_fields.values() if f.alias in shared}


@pytest.mark.parametrize("hyperparameters, words", [
    ({"seed": "-1"}, ["--seed must be >= 0, --gradient-accumulation and --keep-checkpoints >= 1"]),
    ({"train": "lora"}, ["--train lora needs --pretrained"]),
    ({"lora-rank": "0"}, ["--lora-rank and --lora-alpha must be >= 1"]),
    ({"compile": "sometimes"}, ["compile", "expected true or false, got 'sometimes'"]),
    ({"strategy": "zero"}, ["strategy", "'zero'"]),  # a type or a choice: argparse's words, the same name and value
    ({"batch-size": "four"}, ["batch-size", "'four'"]),
    ({"lerning-rate": "1e-4"}, ["lerning-rate"]),  # argparse's "unrecognized arguments"; the Lambda names the nearest
])
def test_the_lambda_refuses_what_the_trainer_refuses(hyperparameters, words, tmp_path, capsys, monkeypatch):
    # GIVEN hyperparameters the trainer refuses at start (SM_HPS, all strings, as SageMaker passes them)
    monkeypatch.setenv("SM_HPS", json.dumps(hyperparameters))
    with pytest.raises(SystemExit) as exit_:
        train_args.parse_args(["--train-dir", str(tmp_path), "--model-dir", str(tmp_path)])
    trainer_says = capsys.readouterr().err.splitlines()[-1]

    # THEN the start-training function's check refuses them too, in the same words
    lambda_says = recipe.refusal(hyperparameters)
    assert exit_.value.code == 2 and lambda_says
    assert [w for w in words if w not in trainer_says or w not in lambda_says] == []


def test_the_lambda_takes_what_the_trainer_takes():
    assert recipe.refusal({"seed": "3", "compile": "True", "batch-size": "8", "cpu-threads": "2", "task": "train",
                           "sagemaker_program": "x"}) is None
    assert recipe.refusal({"train": "lora"}, added={"pretrained": "pretrained"}) is None


def test_every_run_preset_s_stages_are_recipe_stages():
    for path in sorted((REPO / "trainer" / "configs" / "runs").glob("*.json")):
        stages = json.loads(path.read_text())["phases"]
        assert [Phase.model_validate(stage).model_dump(exclude_defaults=True) for stage in stages] == stages, path


def test_the_evaluation_s_options_take_the_older_spelling_once(monkeypatch):
    # GIVEN recipes written with `max_samples`, the spelling the evaluation job took before it had recipe options
    monkeypatch.delenv("SM_HPS", raising=False)
    assert EvaluateOptions.model_validate({"max_samples": "12"}).max_samples == 12
    assert evaluate.parse_args(["--model-dir", "m", "--max_samples", "12"]).max_samples == 12
    assert recipe.refusal({"max_samples": "12", "timesteps": "100,900"}, EvaluateOptions) is None
    # WHEN both spellings, or timesteps the job cannot use, are given THEN they are refused in the check's words
    assert recipe.refusal({"max_samples": "12", "max-samples": "4"}, EvaluateOptions) == \
        "max_samples and max-samples name one option: give one of them"
    assert recipe.refusal({"timesteps": "100,100"}, EvaluateOptions) == \
        "timesteps '100,100': timesteps are distinct non-negative integers, comma-separated"
    assert recipe.refusal({"max-samples": "0"}, EvaluateOptions) == "max-samples '0': must be at least 1"
