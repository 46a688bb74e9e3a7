"""Stage settings parsed once from each function's environment: ingest, pack, deploy, sweep, redrive and import
(core/<stage>/settings.py), what they share (core/settings.py), and the template's environments."""

from __future__ import annotations

from typing import Any

import pytest

from atelier.local.template import Expanded, load_tuning
from contracts.recipe_file import packaged
from core.errors import ConfigError
from core.ingest.images import DecodePolicy
from core.deploy.settings import DeploySettings
from core.import_shard.settings import ImportSettings
from core.ingest.settings import IngestSettings
from core.pack.settings import PackSettings
from core.redrive.settings import RedriveSettings
from core.start_training.run_plan import PlannedJob
from core.sweep.settings import SweepSettings
from core.start_training.settings import TrainingSettings
from tests.support import REPO, TEST_ENVIRONMENT
from tests.unit.settings_helpers import expanded  # noqa: F401 (a fixture)
from tests.unit.settings_helpers import (
    ALL,
    DEFAULTS,
    DEPLOY_ENV,
    INGEST_ENV,
    INGEST_SETTINGS,
    PACK_ENV,
    PACK_SETTINGS,
    TRAINING_ENV,
    function_environment,
)

def test_training_settings_from_a_full_environment() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV) == TrainingSettings(
        table="atelier-PipelineTable", data_bucket="atelier-data", models_bucket="atelier-models", quota=16,
        role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
        volume_gb=200, max_runtime_s=432000, max_retries=3, lineage="main", concurrency="queue", replay_share=0.2,
        keep_alive_s=600, subnets=("subnet-a", "subnet-b"), security_groups=("sg-1",),
        kms_key="arn:aws:kms:us-east-1:123456789012:key/1234abcd",
        run_plan=(PlannedJob("main", "ml.p5.48xlarge", 2, {"steps": "100000", "batch-size": "32"}),),
        use="commercial", max_consecutive_failures=3, failure_backoff_s=600, gpus_per_instance=0,
        tokenizer_instance_type="ml.g5.2xlarge")


def test_ingest_settings_from_a_full_environment() -> None:
    assert IngestSettings.from_env(INGEST_ENV) == INGEST_SETTINGS


def test_pack_settings_from_a_full_environment() -> None:
    assert PackSettings.from_env(PACK_ENV) == PackSettings(**PACK_SETTINGS)


@pytest.mark.parametrize("lanes", ["0", "65"])
def test_pack_lanes_outside_what_the_template_allows_are_refused(lanes: str) -> None:
    with pytest.raises(ConfigError, match=f"PACK_LANES={lanes} is outside 1..64"):
        PackSettings.from_env({**PACK_ENV, "PACK_LANES": lanes})


def test_deploy_settings_from_a_full_environment() -> None:
    assert DeploySettings.from_env(DEPLOY_ENV) == DeploySettings(
        table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img", endpoint_name="atelier",
        instance_type="ml.g5.xlarge", training_image_uri="train-img", eval_instance_type="ml.g5.2xlarge",
        eval_data_uri="s3://d/eval/", clip_model_uri="s3://m/clip/", eval_hyperparameters={"seed": "1"},
        models_bucket="m", max_eval_runtime_s=600, gate_max_loss=0.9, gate_max_loss_ratio=1.02,
        gate_min_clip_delta=0.25, rollback_alarms=("a-5xx", "a-latency"), traffic_routing="LINEAR",
        canary_percent=20, wait_interval_s=60, bake_s=120, max_rollout_s=1800, min_instances=2, max_instances=6,
        invocations_per_instance=30, kms_key="", startup_timeout_s=900, serve_environment={"SERVE_COMPILE": "off"},
        signing_secret_arn="arn:aws:secretsmanager:us-east-1:123456789012:secret:s-AbCdEf")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TRAFFIC_ROUTING", "ROLLING", "is not one of"),
    ("CANARY_PERCENT", "60", "outside 1..50"),
    ("GATE_MAX_LOSS_RATIO", "nan", "not a finite number"),
    ("EVAL_HYPERPARAMETERS", '{"a": [1]}', "must be flat"),
    ("ENDPOINT_STARTUP_TIMEOUT_S", "30", "outside 60..3600"),  # AWS's range for the variant's field
    ("ENDPOINT_STARTUP_TIMEOUT_S", "3601", "outside 60..3600"),
    ("SERVE_ENVIRONMENT", '{"SERVE_COMPLE": "off"}', r"\['SERVE_COMPLE'\] are not the model server's settings; it reads"),
    ("SERVE_ENVIRONMENT", '{"ATELIER_MODEL_ID": "x"}', r"\['ATELIER_MODEL_ID'\] are not the model server's settings"),
    ("SERVE_ENVIRONMENT", '{"SERVE_WARMUP_IMAGES": "' + "1," * 512 + '1"}', "longer than SageMaker's 1024 characters"),
    ("SERVE_ENVIRONMENT", '["SERVE_COMPILE"]', "must be a JSON object"),
])
def test_deploy_settings_reject_bad_values(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeploySettings.from_env({**DEPLOY_ENV, name: value})


def test_from_env_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PACK_ENV.items():
        monkeypatch.setenv(name, value)

    assert PackSettings.from_env() == PackSettings(**PACK_SETTINGS)


@pytest.mark.parametrize(("settings", "env", "name"),
                         [(cls, env, name) for cls, env in ALL for name in env if name not in DEFAULTS],
                         ids=[f"{cls.__name__}-{name}" for cls, env in ALL for name in env if name not in DEFAULTS])
def test_missing_variable_is_a_config_error_naming_it(settings: Any, env: dict[str, str], name: str) -> None:
    incomplete = {k: v for k, v in env.items() if k != name}

    with pytest.raises(ConfigError, match=name):
        settings.from_env(incomplete)


def test_empty_variable_counts_as_missing() -> None:
    with pytest.raises(ConfigError, match="DATA_BUCKET"):
        TrainingSettings.from_env({**TRAINING_ENV, "DATA_BUCKET": ""})


@pytest.mark.parametrize("name", ["TRAINING_QUOTA", "TRAINING_INSTANCE_COUNT", "TRAINING_VOLUME_GB",
                                  "TRAINING_MAX_RUNTIME_S", "TRAINING_MAX_RETRIES", "TRAINING_KEEP_ALIVE_S",
                                  "TRAINING_GPUS_PER_INSTANCE"])
@pytest.mark.parametrize("value", ["two", "2.5", "1e3"])
def test_non_integer_is_a_config_error(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TrainingSettings.from_env({**TRAINING_ENV, name: value})


# --- ingest policy values ---------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value"), [
    *[(name, value) for name in ("MAX_UPLOAD_BYTES", "MAX_IMAGE_PIXELS", "MIN_SHORT_SIDE", "STORE_MAX_SIDE",
                                 "STORE_JPEG_QUALITY", "NEAR_DUPLICATE_DISTANCE", "NEAR_DUPLICATE_COLOUR_DISTANCE")
      for value in ("lots", "2.5", "1e3")],
    ("MAX_ASPECT_RATIO", "wide"), ("MAX_ASPECT_RATIO", "4:1"),
    ("ALLOWED_FORMATS", "jpeg,heic"), ("ALLOWED_FORMATS", "jpg"), ("ALLOWED_FORMATS", ","), ("ALLOWED_FORMATS", "svg"),
    ("REENCODE", "never"), ("REENCODE", "Always"), ("REENCODE", "true"),
    ("ALPHA_BACKGROUND", "white"), ("ALPHA_BACKGROUND", "255,255"), ("ALPHA_BACKGROUND", "255,255,255,0"),
    ("ALPHA_BACKGROUND", "256,0,0"), ("ALPHA_BACKGROUND", "-1,0,0"), ("ALPHA_BACKGROUND", "#ffffff"),
    ("ALPHA_BACKGROUND", "0.5,0,0"),
    ("NEAR_DUPLICATE_DISTANCE", "4"), ("NEAR_DUPLICATE_DISTANCE", "64"), ("NEAR_DUPLICATE_DISTANCE", "-1"),
    ("NEAR_DUPLICATE_COLOUR_DISTANCE", "256"), ("NEAR_DUPLICATE_COLOUR_DISTANCE", "-1"),
])
def test_malformed_ingest_value_is_a_config_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        IngestSettings.from_env({**INGEST_ENV, name: value})


@pytest.mark.parametrize(("name", "value"), [
    pytest.param("STORE_JPEG_QUALITY", "0", id="quality-0"),  # template: MinValue 50
    pytest.param("STORE_JPEG_QUALITY", "101", id="quality-101"),  # template: MaxValue 100
    pytest.param("STORE_MAX_SIDE", "0", id="max-side-0"),  # JPEG draft divides by it
    pytest.param("MAX_ASPECT_RATIO", "0.5", id="aspect-under-1"),  # every image would be bad_aspect
    pytest.param("MAX_ASPECT_RATIO", "nan", id="aspect-nan"),  # no image would ever be bad_aspect
    pytest.param("MAX_IMAGE_PIXELS", "0", id="pixels-0"),  # every image would be too_many_pixels
    pytest.param("MAX_UPLOAD_BYTES", "0", id="bytes-0"),  # every upload would be too_large
])
def test_ingest_value_out_of_its_range_is_a_config_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        IngestSettings.from_env({**INGEST_ENV, name: value})


def test_allowed_formats_are_normalised() -> None:
    settings = IngestSettings.from_env({**INGEST_ENV, "ALLOWED_FORMATS": " JPEG, png ,,GIF "})

    assert settings.decode.allowed == frozenset({"jpeg", "png", "gif"})


def test_alpha_background_may_have_spaces() -> None:
    assert IngestSettings.from_env({**INGEST_ENV, "ALPHA_BACKGROUND": "0, 128 ,255"}).decode.background == (0, 128, 255)


@pytest.mark.parametrize("distance", ["0", "3"])
def test_near_duplicate_distance_up_to_three_is_accepted(distance: str) -> None:
    settings = IngestSettings.from_env({**INGEST_ENV, "NEAR_DUPLICATE_DISTANCE": distance})

    assert settings.near_duplicate_distance == int(distance)


def test_fractional_aspect_ratio_is_accepted() -> None:
    assert IngestSettings.from_env({**INGEST_ENV, "MAX_ASPECT_RATIO": "2.5"}).max_aspect_ratio == 2.5



# --- the template gives each function what its settings need --------------------------------------


@pytest.mark.parametrize(("logical_id", "settings"), [
    ("IngestFunction", IngestSettings), ("PackFunction", PackSettings),
    ("StartTrainingFunction", TrainingSettings), ("DeployFunction", DeploySettings),
])
def test_each_function_environment_in_the_template_parses(expanded: Expanded, logical_id: str, settings: Any) -> None:
    # with the default recipe's values, which the start-training and deploy functions read with their settings
    assert isinstance(settings.from_env({**function_environment(expanded, logical_id), **packaged().settings()}),
                      settings)


def test_the_template_passes_no_setting_that_the_recipe_gives(expanded: Expanded) -> None:
    functions = [name for name, r in expanded.resources.items() if r["Type"] == "AWS::Lambda::Function"]

    assert {name: sorted(set(function_environment(expanded, name)) & set(packaged().settings())) for name in functions} \
        == {name: [] for name in functions}


def test_the_template_passes_no_setting_that_has_a_default_in_code(expanded: Expanded) -> None:
    functions = [name for name, r in expanded.resources.items() if r["Type"] == "AWS::Lambda::Function"]

    assert len(functions) == 7
    assert {name: sorted(set(function_environment(expanded, name)) & set(DEFAULTS)) for name in functions} \
        == {name: [] for name in functions}


def test_the_local_stacks_tuning_names_only_tuning_knobs() -> None:
    # tuning/local.toml (atelier local up) and the tests' TEST_ENVIRONMENT set variables the settings default
    assert set(load_tuning(REPO, "local")) | set(TEST_ENVIRONMENT) <= set(DEFAULTS)


def test_settings_without_their_variable_take_the_defaults_in_code() -> None:
    ingest = IngestSettings.from_env({k: v for k, v in INGEST_ENV.items() if k not in DEFAULTS})
    sweep = SweepSettings.from_env({"PIPELINE_TABLE": "t", "UPLOADS_BUCKET": "u", "UPLOADS_QUEUE_URL": "q",
                                    "SWEEP_GRACE_S": "600", "SIDECAR_ORPHAN_GRACE_S": "3600"})
    redrive = RedriveSettings.from_env({"PIPELINE_TABLE": "t", "EVENT_BUS_NAME": "default", "DEAD_LETTER_QUEUES": "{}",
                                        "DEAD_LETTER_REDRIVE_CAP": "3", "DEAD_LETTER_BACKOFF_S": "300"})

    assert (ingest.decode.max_pixels, ingest.decode.background, ingest.max_sidecar_bytes, ingest.max_sidecar_depth,
            sweep.lookback_s, sweep.max_queue_depth, redrive.policy.memory_s) == (
        178956970, (255, 255, 255), 65536, 4, 86400, 1000, 86400)


def test_a_variable_still_overrides_the_default_in_code() -> None:
    ingest = IngestSettings.from_env({**INGEST_ENV, "MAX_SIDECAR_DEPTH": "9", "ALPHA_BACKGROUND": "0,0,0"})

    assert (ingest.max_sidecar_depth, ingest.decode.background) == (9, (0, 0, 0))
    with pytest.raises(ConfigError, match="MAX_SIDECAR_DEPTH"):  # and is checked like any other
        IngestSettings.from_env({**INGEST_ENV, "MAX_SIDECAR_DEPTH": "0"})


def test_template_ingest_defaults_parse_to_exact_settings(expanded: Expanded) -> None:
    parsed = IngestSettings.from_env(function_environment(expanded, "IngestFunction"))

    assert (parsed.max_upload_bytes, parsed.decode, parsed.min_short_side, parsed.max_aspect_ratio,
            parsed.jpeg_quality, parsed.near_duplicate_distance, parsed.near_duplicate_colour_distance) == (
        209715200, DecodePolicy(allowed=frozenset({"jpeg", "png", "webp", "tiff"}), max_pixels=178956970,
                                background=(255, 255, 255), max_side=2048, reencode="auto"),
        256, 4.0, 95, 3, 16)


def test_the_near_duplicate_thresholds_reach_ingest_and_import_from_their_variables(expanded: Expanded) -> None:
    # tuning knobs: one default, the settings' (the template's parameters' before), each variable overriding it
    variables = {"NEAR_DUPLICATE_DISTANCE": "2", "NEAR_DUPLICATE_COLOUR_DISTANCE": "40"}
    for environment, expected in (({}, (3, 16)), (variables, (2, 40))):
        ingest = IngestSettings.from_env({**function_environment(expanded, "IngestFunction"), **environment})
        imported = ImportSettings.from_env({**function_environment(expanded, "ImportFunction"), **environment}).ingest

        assert [(s.near_duplicate_distance, s.near_duplicate_colour_distance) for s in (ingest, imported)] \
            == [expected] * 2


