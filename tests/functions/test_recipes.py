"""The current recipe on the stack (core/recipes.py, `atelier recipe show|set`): stored content-addressed, the
pointer moved on condition, read back verified, and recorded by the start-training function on what it starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from tests.functions.test_audit import register_outputs

from atelier import cli
from atelier.local.provision import Provisioned
from contracts.recipe_file import RECIPE_POINTER, DigestMismatch, key, packaged
from core import aws, recipes
from core.start_training.settings import TrainingSettings
from tests.functions.training_jobs_helpers import (FakeSageMaker, configure, lineage, sagemaker, seal,  # noqa: F401
                                                   settings, stack)
from tests.support import TEST_RECIPE


@pytest.fixture(scope="module")
def registered(stack: Provisioned) -> Provisioned:
    register_outputs(stack)  # the CLI finds the table and the models bucket in the stack's outputs
    return stack


@pytest.fixture
def names(registered: Provisioned, sagemaker: FakeSageMaker) -> tuple[str, str]:
    """The stack with TEST_RECIPE current (`sagemaker` empties it and sets that again)."""
    return registered.outputs["PipelineTableName"], registered.outputs["ModelsBucketName"]


def stored_keys(bucket: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="recipes/").get("Contents", [])
    return sorted(o["Key"] for o in listed)


def recipe_file(tmp_path: Path, changes: dict[str, Any]) -> Path:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(packaged().recipe.changed(changes).model_dump(mode="json")))
    return path


def test_show_prints_the_current_recipe_as_set_takes_it(names: tuple[str, str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    current = recipes.current(*names)

    assert cli.main(["recipe", "show"]) == 0
    printed = capsys.readouterr()
    assert printed.err == f"recipe {current.digest} (s3://{names[1]}/recipes/{current.digest}.json)\n"
    assert json.loads(printed.out) == packaged().recipe.changed(TEST_RECIPE).model_dump(mode="json")


def test_set_stores_the_file_by_its_digest_and_moves_the_pointer(names: tuple[str, str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    table, bucket = names
    before = recipes.current(table, bucket).digest
    new = packaged().recipe.changed({"evaluation": {"max_loss": 1.5}})

    assert cli.main(["recipe", "set", str(recipe_file(tmp_path, {"evaluation": {"max_loss": 1.5}}))]) == 0

    assert capsys.readouterr().out == f"s3://{bucket}/{key(new.digest)}\n"
    assert aws.read_object(bucket, key(new.digest)) == new.canonical()
    assert recipes.current(table, bucket).recipe == new
    assert {k: v for k, v in aws.get_item(table, RECIPE_POINTER).items() if k != "set_at"} == {
        "pk": RECIPE_POINTER, "uri": f"s3://{bucket}/{key(new.digest)}", "digest": new.digest, "previous": before}


def test_set_refuses_a_bad_recipe_in_the_trainer_s_words_and_writes_nothing(
        names: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table, bucket = names
    before, listed = aws.get_item(table, RECIPE_POINTER), stored_keys(bucket)
    path = recipe_file(tmp_path, {"training": {"hyperparameters": {"lerning-rate": "1e-4"}, "run_plan": []}})

    code = cli.main(["recipe", "set", str(path)])

    assert (code, capsys.readouterr().err) == (2, (
        f"error: {path}: training.run_plan job 'main': hyperparameter 'lerning-rate' is not an option of the job "
        "(did you mean 'learning-rate'?)\n"))
    assert (aws.get_item(table, RECIPE_POINTER), stored_keys(bucket)) == (before, listed)


def test_set_refuses_an_unknown_key_naming_it(names: tuple[str, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({**packaged().recipe.model_dump(mode="json"), "gate": {"max_loss": 2}}))

    assert cli.main(["recipe", "set", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: {path}: gate: not a key of the recipe (version 1); known: evaluation, "
                                       "serve, training, version\n")


def test_a_set_against_a_stale_digest_is_refused_and_the_first_one_stays(names: tuple[str, str]) -> None:
    # GIVEN two operators who both read the current recipe
    table, bucket = names
    read = recipes.current(table, bucket).digest
    first = packaged().recipe.changed({"evaluation": {"max_loss": 1.5}})
    second = packaged().recipe.changed({"evaluation": {"max_loss": 3.0}})
    recipes.put(first, table, bucket, expected_digest=read)

    # WHEN the second sets theirs against what they read
    with pytest.raises(recipes.StaleRecipe, match=f"expected digest {read}, the current one is {first.digest}"):
        recipes.put(second, table, bucket, expected_digest=read)

    # THEN the first one's stays current
    assert recipes.current(table, bucket).digest == first.digest


def test_a_stored_recipe_whose_bytes_changed_is_refused_when_read(names: tuple[str, str]) -> None:
    table, bucket = names
    digest = recipes.current(table, bucket).digest
    changed = packaged().recipe.changed({"evaluation": {"max_loss": 9.0}}).canonical()
    boto3.client("s3").put_object(Bucket=bucket, Key=key(digest), Body=changed)

    with pytest.raises(DigestMismatch, match=f"recipe recipes/{digest}.json has digest"):
        recipes.current(table, bucket)


def test_without_a_recipe_set_the_packaged_default_is_current(names: tuple[str, str]) -> None:
    table, bucket = names
    boto3.client("dynamodb").delete_item(TableName=table, Key={"pk": {"S": RECIPE_POINTER}})

    assert recipes.current(table, bucket) == packaged()


def test_a_job_is_started_with_the_current_recipe_s_hyperparameters_and_records_its_digest(
        configure, sagemaker: FakeSageMaker) -> None:
    # GIVEN a recipe set on the stack
    settings: TrainingSettings = configure(recipe={"training": {"hyperparameters": {
        "steps": "3", "batch-size": "2", "resolution": "32", "model-config": "tiny", "seed": "7"}}})
    stored = recipes.current(settings.table, settings.models_bucket)

    # WHEN its shards reach the quota
    name = seal(settings, 1, 2)[1].job_name

    # THEN the job trains with the recipe's hyperparameters, and its tag, its record and its lineage name the recipe
    request = sagemaker.request(name)
    assert request["HyperParameters"] == {"steps": "3", "batch-size": "2", "resolution": "32", "model-config": "tiny",
                                          "seed": "7"}
    assert {t["Key"]: t["Value"] for t in request["Tags"]}["atelier:recipe"] == stored.digest
    job = aws.get_item(settings.table, f"JOB#{name}")
    assert (job["recipe"], job["recipe_uri"]) == (stored.digest, stored.uri)
    assert lineage(settings)["recipe"] == stored.digest
    assert (settings.recipe_digest, settings.recipe_uri) == (stored.digest, stored.uri)
