"""core.settings: typed settings parsed once from each function's environment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from atelier.local.template import Expanded, Resolver, expand
from core.errors import ConfigError
from core.settings import DeploySettings, IngestSettings, PackSettings, TrainingSettings

REPO = Path(__file__).resolve().parents[2]

TRAINING_ENV = {
    "PIPELINE_TABLE": "atelier-PipelineTable",
    "DATA_BUCKET": "atelier-data",
    "MODELS_BUCKET": "atelier-models",
    "TRAINING_QUOTA": "8",
    "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
    "TRAINING_IMAGE_URI": "atelier-trainer:latest",
    "TRAINING_INSTANCE_TYPE": "ml.p5.48xlarge",
    "TRAINING_INSTANCE_COUNT": "2",
    "TRAINING_VOLUME_GB": "200",
    "TRAINING_MAX_RUNTIME_S": "432000",
    "TRAINING_MAX_RETRIES": "3",
    "TRAINING_LINEAGE": "main",
    "TRAINING_HYPERPARAMETERS": '{"steps": "100000", "batch-size": "32"}',
}
INGEST_ENV = {"PIPELINE_TABLE": "t", "PACK_QUEUE_URL": "https://sqs/q", "MAX_UPLOAD_BYTES": "209715200",
              "MAX_IMAGE_PIXELS": "178956970"}
PACK_ENV = {"PIPELINE_TABLE": "t", "DATA_BUCKET": "d", "EVENT_BUS_NAME": "default"}
DEPLOY_ENV = {"PIPELINE_TABLE": "t", "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/r",
              "INFERENCE_IMAGE_URI": "img", "ENDPOINT_NAME": "atelier", "ENDPOINT_INSTANCE_TYPE": "ml.g5.xlarge"}
ALL = [(TrainingSettings, TRAINING_ENV), (IngestSettings, INGEST_ENV), (PackSettings, PACK_ENV),
       (DeploySettings, DEPLOY_ENV)]


def test_training_settings_from_a_full_environment() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV) == TrainingSettings(
        table="atelier-PipelineTable", data_bucket="atelier-data", models_bucket="atelier-models", quota=8,
        role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
        instance_type="ml.p5.48xlarge", instance_count=2, volume_gb=200, max_runtime_s=432000, max_retries=3,
        lineage="main", hyperparameters={"steps": "100000", "batch-size": "32"})


def test_ingest_settings_from_a_full_environment() -> None:
    assert IngestSettings.from_env(INGEST_ENV) == IngestSettings(
        table="t", pack_queue_url="https://sqs/q", max_upload_bytes=209715200, max_image_pixels=178956970)


def test_pack_settings_from_a_full_environment() -> None:
    assert PackSettings.from_env(PACK_ENV) == PackSettings(table="t", data_bucket="d", event_bus="default")


def test_deploy_settings_from_a_full_environment() -> None:
    assert DeploySettings.from_env(DEPLOY_ENV) == DeploySettings(
        table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img", endpoint_name="atelier",
        instance_type="ml.g5.xlarge")


def test_from_env_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PACK_ENV.items():
        monkeypatch.setenv(name, value)

    assert PackSettings.from_env() == PackSettings(table="t", data_bucket="d", event_bus="default")


@pytest.mark.parametrize(("settings", "env", "name"),
                         [(cls, env, name) for cls, env in ALL for name in env],
                         ids=[f"{cls.__name__}-{name}" for cls, env in ALL for name in env])
def test_missing_variable_is_a_config_error_naming_it(settings: Any, env: dict[str, str], name: str) -> None:
    incomplete = {k: v for k, v in env.items() if k != name}

    with pytest.raises(ConfigError, match=name):
        settings.from_env(incomplete)


def test_empty_variable_counts_as_missing() -> None:
    with pytest.raises(ConfigError, match="DATA_BUCKET"):
        TrainingSettings.from_env({**TRAINING_ENV, "DATA_BUCKET": ""})


@pytest.mark.parametrize("name", ["TRAINING_QUOTA", "TRAINING_INSTANCE_COUNT", "TRAINING_VOLUME_GB",
                                  "TRAINING_MAX_RUNTIME_S", "TRAINING_MAX_RETRIES"])
@pytest.mark.parametrize("value", ["two", "2.5", "1e3"])
def test_non_integer_is_a_config_error(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TrainingSettings.from_env({**TRAINING_ENV, name: value})


@pytest.mark.parametrize("name", ["MAX_UPLOAD_BYTES", "MAX_IMAGE_PIXELS"])
def test_non_integer_ingest_limit_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        IngestSettings.from_env({**INGEST_ENV, name: "lots"})


@pytest.mark.parametrize("raw", [
    pytest.param("steps=100", id="not-json"),
    pytest.param("{'steps': '100'}", id="python-dict"),
    pytest.param('["steps", "100"]', id="list"),
    pytest.param('"steps"', id="string"),
    pytest.param("100", id="number"),
    pytest.param("null", id="null"),
])
def test_hyperparameters_that_are_not_a_json_object_are_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_HYPERPARAMETERS"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})


def test_hyperparameter_values_become_strings() -> None:
    raw = json.dumps({"steps": 30, "learning-rate": 0.0005, "model-config": "tiny"})

    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})

    assert settings.hyperparameters == {"steps": "30", "learning-rate": "0.0005", "model-config": "tiny"}


def test_empty_hyperparameter_object_is_allowed() -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": "{}"}).hyperparameters == {}


@pytest.mark.parametrize("raw", [
    pytest.param('{"model": {"depth": 2}}', id="nested-object"),
    pytest.param('{"betas": [0.9, 0.999]}', id="list"),
])
def test_hyperparameters_that_are_not_flat_are_a_config_error(raw: str) -> None:
    # "a flat map of strings; reject anything else early" (core.settings._hyperparameters): a
    # nested value would reach the trainer as a Python repr such as "{'depth': 2}".
    with pytest.raises(ConfigError, match="TRAINING_HYPERPARAMETERS"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})


# --- the template gives each function what its settings need --------------------------------------

@pytest.fixture(scope="module")
def expanded() -> Expanded:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # samtranslator asks boto for a region
        return expand(REPO / "template.yaml", {}, "atelier", "us-east-1", "123456789012")


def function_environment(expanded: Expanded, logical_id: str) -> dict[str, str]:
    """The function's variables as CloudFormation would set them (resources by logical id)."""
    resolver = Resolver(expanded.parameters, expanded.conditions, ref=lambda name: name,
                        get_att=lambda name, attribute: f"{name}.{attribute}")
    variables = resolver.resolve(expanded.resources[logical_id]["Properties"]["Environment"]["Variables"])
    return {k: str(v) for k, v in variables.items()}


@pytest.mark.parametrize(("logical_id", "settings"), [
    ("IngestFunction", IngestSettings), ("PackFunction", PackSettings),
    ("StartTrainingFunction", TrainingSettings), ("DeployFunction", DeploySettings),
])
def test_each_function_environment_in_the_template_parses(expanded: Expanded, logical_id: str, settings: Any) -> None:
    assert isinstance(settings.from_env(function_environment(expanded, logical_id)), settings)


def test_template_training_defaults_parse_to_exact_settings(expanded: Expanded) -> None:
    parsed = TrainingSettings.from_env(function_environment(expanded, "StartTrainingFunction"))

    assert (parsed.quota, parsed.max_retries, parsed.lineage, parsed.hyperparameters["model-config"]) \
        == (8, 3, "main", "sd2")
