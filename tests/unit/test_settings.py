"""core.settings: typed settings parsed once from each function's environment."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from atelier.local.template import Expanded, Resolver, expand
from core.errors import ConfigError
from core.ingest.images import DecodePolicy
DEFAULTS = {"MAX_IMAGE_PIXELS", "MAX_SIDECAR_BYTES", "MAX_SIDECAR_DEPTH", "ALPHA_BACKGROUND", "SWEEP_LOOKBACK_S", "SWEEP_MAX_QUEUE_DEPTH", "DEAD_LETTER_MEMORY_S"}  # tuning knobs: the template passes none
from core.deploy.settings import DeploySettings
from core.import_shard.settings import ImportSettings
from core.ingest.settings import IngestSettings
from core.pack.settings import PackSettings
from core.redrive.settings import RedriveSettings
from core.start_training.run_plan import PlannedJob, check_sharding
from core.sweep.settings import SweepSettings
from core.start_training.settings import TrainingSettings
from core.start_training.instance_types import GPUS_PER_INSTANCE
from tests.support import IMAGES

REPO = Path(__file__).resolve().parents[2]

TRAINING_ENV = {
    "PIPELINE_TABLE": "atelier-PipelineTable",
    "DATA_BUCKET": "atelier-data",
    "MODELS_BUCKET": "atelier-models",
    "TRAINING_QUOTA": "16",  # 8 shards for each of the two instances' 8 GPUs
    "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
    "TRAINING_IMAGE_URI": "atelier-trainer:latest",
    "TRAINING_INSTANCE_TYPE": "ml.p5.48xlarge",
    "TRAINING_INSTANCE_COUNT": "2",
    "TRAINING_VOLUME_GB": "200",
    "TRAINING_MAX_RUNTIME_S": "432000",
    "TRAINING_MAX_RETRIES": "3",
    "TRAINING_LINEAGE": "main",
    "TRAINING_HYPERPARAMETERS": '{"steps": "100000", "batch-size": "32"}',
    "TRAINING_CONCURRENCY": "queue",
    "TRAINING_REPLAY_SHARE": "0.2",
    "TRAINING_MAX_CONSECUTIVE_FAILURES": "3",
    "TRAINING_FAILURE_BACKOFF_S": "600",
    "TRAINING_KEEP_ALIVE_S": "600",
    "TRAINING_SUBNETS": "subnet-a,subnet-b",
    "TRAINING_SECURITY_GROUPS": "sg-1",
    "TRAINING_KMS_KEY": "arn:aws:kms:us-east-1:123456789012:key/1234abcd",
    "TRAINING_GPUS_PER_INSTANCE": "0",
    "TRAINING_RUN_PLAN": "",
    "TRAINING_USE": "commercial",
}
# Empty or absent, these mean "none" (the template joins empty lists to ""): not required.
TRAINING_OPTIONAL = ("TRAINING_SUBNETS", "TRAINING_SECURITY_GROUPS", "TRAINING_KMS_KEY", "TRAINING_RUN_PLAN")
TRAINING_REQUIRED = {k: v for k, v in TRAINING_ENV.items() if k not in TRAINING_OPTIONAL}
INGEST_ENV = {"PIPELINE_TABLE": "t", "PACK_QUEUE_URL": "https://sqs/q", "DATA_BUCKET": "d",
              "MAX_UPLOAD_BYTES": "209715200", "MAX_SIDECAR_BYTES": "65536", "MAX_SIDECAR_DEPTH": "4", "MAX_CAPTION_CHARS": "2000", "MAX_IMAGE_PIXELS": "178956970", "ALLOWED_FORMATS": "jpeg,png,webp,tiff",
              "MIN_SHORT_SIDE": "256", "MAX_ASPECT_RATIO": "4", "STORE_MAX_SIDE": "2048", "STORE_JPEG_QUALITY": "95",
              "REENCODE": "auto", "ALPHA_BACKGROUND": "255,255,255", "NEAR_DUPLICATE_DISTANCE": "3",
              "NEAR_DUPLICATE_COLOUR_DISTANCE": "12", "PACK_LANES": "2", "SIDECAR_ORPHAN_GRACE_S": "3600"}
INGEST_SETTINGS = IngestSettings(
    table="t", pack_queue_url="https://sqs/q", data_bucket="d", max_upload_bytes=209715200,
    decode=DecodePolicy(allowed=frozenset({"jpeg", "png", "webp", "tiff"}), max_pixels=178956970,
                        background=(255, 255, 255), max_side=2048, reencode="auto"),
    min_short_side=256, max_aspect_ratio=4.0, jpeg_quality=95, near_duplicate_distance=3,
    near_duplicate_colour_distance=12, pack_lanes=2, max_caption_chars=2000, sidecar_orphan_grace_s=3600)
PACK_ENV = {"PIPELINE_TABLE": "t", "DATA_BUCKET": "d", "EVENT_BUS_NAME": "default",
            "SHARD_TARGET_BYTES": "1073741824", "SHARD_MAX_SAMPLES": "10000", "SHARD_MAX_AGE_S": "3600",
            "PACK_LANES": "4"}
PACK_SETTINGS = dict(table="t", data_bucket="d", event_bus="default", shard_target_bytes=1073741824,
                     shard_max_samples=10000, shard_max_age_s=3600, lanes=4)
DEPLOY_ENV = {"PIPELINE_TABLE": "t", "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/r",
              "INFERENCE_IMAGE_URI": "img", "ENDPOINT_NAME": "atelier", "ENDPOINT_INSTANCE_TYPE": "ml.g5.xlarge",
              "TRAINING_IMAGE_URI": "train-img", "EVAL_INSTANCE_TYPE": "ml.g5.2xlarge", "EVAL_DATA_URI": "s3://d/eval/",
              "CLIP_MODEL_URI": "s3://m/clip/", "EVAL_HYPERPARAMETERS": '{"seed": "1"}', "MODELS_BUCKET": "m",
              "MAX_EVAL_RUNTIME_S": "600", "GATE_MAX_LOSS": "0.9", "GATE_MAX_LOSS_RATIO": "1.02",
              "GATE_MIN_CLIP_DELTA": "0.25", "ROLLBACK_ALARMS": "a-5xx, a-latency", "TRAFFIC_ROUTING": "LINEAR",
              "CANARY_PERCENT": "20", "WAIT_INTERVAL_S": "60", "BAKE_S": "120", "MAX_ROLLOUT_S": "1800",
              "MIN_INSTANCES": "2", "MAX_INSTANCES": "6", "INVOCATIONS_PER_INSTANCE": "30", "KMS_KEY_ARN": "",
              "ENDPOINT_STARTUP_TIMEOUT_S": "900", "SERVE_ENVIRONMENT": '{"SERVE_COMPILE": "off"}',
              "C2PA_SIGNING_SECRET_ARN": "arn:aws:secretsmanager:us-east-1:123456789012:secret:s-AbCdEf"}
# may be empty: no CLIP scorer, no extra evaluation hyperparameters, no alarms, no KMS key, unsigned images
DEPLOY_OPTIONAL = {"CLIP_MODEL_URI", "EVAL_HYPERPARAMETERS", "ROLLBACK_ALARMS", "KMS_KEY_ARN", "SERVE_ENVIRONMENT",
                   "C2PA_SIGNING_SECRET_ARN"}
DEPLOY_REQUIRED = {k: v for k, v in DEPLOY_ENV.items() if k not in DEPLOY_OPTIONAL}
ALL = [(TrainingSettings, TRAINING_REQUIRED), (IngestSettings, INGEST_ENV), (PackSettings, PACK_ENV),
       (DeploySettings, DEPLOY_REQUIRED)]


def test_training_settings_from_a_full_environment() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV) == TrainingSettings(
        table="atelier-PipelineTable", data_bucket="atelier-data", models_bucket="atelier-models", quota=16,
        role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
        volume_gb=200, max_runtime_s=432000, max_retries=3, lineage="main", concurrency="queue", replay_share=0.2,
        keep_alive_s=600, subnets=("subnet-a", "subnet-b"), security_groups=("sg-1",),
        kms_key="arn:aws:kms:us-east-1:123456789012:key/1234abcd",
        run_plan=(PlannedJob("main", "ml.p5.48xlarge", 2, {"steps": "100000", "batch-size": "32"}),),
        use="commercial", max_consecutive_failures=3, failure_backoff_s=600, gpus_per_instance=0)


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

    assert settings.run_plan[0].hyperparameters == {"steps": "30", "learning-rate": "0.0005", "model-config": "tiny"}


def test_empty_hyperparameter_object_is_allowed() -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": "{}"}).run_plan[0].hyperparameters == {}


@pytest.mark.parametrize("raw", [
    pytest.param('{"model": {"depth": 2}}', id="nested-object"),
    pytest.param('{"betas": [0.9, 0.999]}', id="list"),
])
def test_hyperparameters_that_are_not_flat_are_a_config_error(raw: str) -> None:
    # "a flat map of strings; reject anything else early" (core.settings._hyperparameters): a
    # nested value would reach the trainer as a Python repr such as "{'depth': 2}".
    with pytest.raises(ConfigError, match="TRAINING_HYPERPARAMETERS"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})


@pytest.mark.parametrize(("hyperparameters", "message"), [
    pytest.param({f"h{i}": "1" for i in range(101)}, "has 101 entries; SageMaker takes at most 100", id="101-entries"),
    pytest.param({"prompts": "p" * 2501}, "'prompts' is over SageMaker's 256 characters a name or 2500 a value",
                 id="long-value"),
    pytest.param({"k" * 257: "1"}, "over SageMaker's 256 characters a name", id="long-name"),
    pytest.param({"validation-prompts": "a red circle\na blue square"}, "'validation-prompts' holds a line break",
                 id="line-break"),
])
def test_hyperparameters_aws_would_refuse_fail_the_function_at_start(hyperparameters: dict, message: str) -> None:
    # CreateTrainingJob's HyperParameters (botocore's model): 100 entries, 256 / 2,500 characters, pattern `.*`
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})
    with pytest.raises(ConfigError, match=re.escape(message)):
        DeploySettings.from_env({**DEPLOY_ENV, "EVAL_HYPERPARAMETERS": json.dumps(hyperparameters)})


def test_hyperparameters_at_the_limits_are_taken() -> None:
    # the evaluation job's (not a recipe yet, so any name): the limits alone decide
    hyperparameters = {f"h{i}": "v" * 2500 for i in range(99)} | {"k" * 256: "1"}

    settings = DeploySettings.from_env({**DEPLOY_ENV, "EVAL_HYPERPARAMETERS": json.dumps(hyperparameters)})

    assert settings.eval_hyperparameters == hyperparameters


def test_a_training_value_at_the_limit_is_taken() -> None:
    hyperparameters = {"validation-prompts": "|".join(["a red circle on a blue background"] * 75)[:2500]}

    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})

    assert settings.run_plan[0].hyperparameters == hyperparameters and len(hyperparameters["validation-prompts"]) == 2500


def test_a_hyperparameter_the_trainer_does_not_know_fails_the_function_at_start_naming_the_nearest() -> None:
    hyperparameters = {"lerning-rate": "1e-4", "batch-size": "2", "sagemaker_program": "train"}

    with pytest.raises(ConfigError, match=re.escape("'lerning-rate' is not an option of the job (did you mean "
                                                    "'learning-rate'?)")):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})


# --- training: the new variables ------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING_OPTIONAL)
@pytest.mark.parametrize("absent", ["missing", "empty"])
def test_optional_training_variables_absent_mean_none(name: str, absent: str) -> None:
    others = {k: v for k, v in TRAINING_ENV.items() if k != name and k in TRAINING_REQUIRED}
    env = others if absent == "missing" else {**others, name: ""}

    settings = TrainingSettings.from_env(env)

    assert (settings.subnets, settings.security_groups, settings.kms_key, len(settings.run_plan)) == ((), (), "", 1)


def test_subnets_and_security_groups_are_trimmed_lists() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_SUBNETS": " subnet-a , ,subnet-b ",
                                          "TRAINING_SECURITY_GROUPS": "sg-1,sg-2"})

    assert (settings.subnets, settings.security_groups) == (("subnet-a", "subnet-b"), ("sg-1", "sg-2"))


@pytest.mark.parametrize("missing", ["TRAINING_SUBNETS", "TRAINING_SECURITY_GROUPS"])
def test_subnets_and_security_groups_go_together(missing: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_SUBNETS and TRAINING_SECURITY_GROUPS"):
        TrainingSettings.from_env({**TRAINING_ENV, missing: ""})


@pytest.mark.parametrize("value", ["skip", "queue"])
def test_concurrency_is_queue_or_skip(value: str) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_CONCURRENCY": value}).concurrency == value


@pytest.mark.parametrize("value", ["parallel", "Queue", "wait", "both"])
def test_other_concurrency_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_CONCURRENCY"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_CONCURRENCY": value})


@pytest.mark.parametrize(("value", "share"), [("0", 0.0), ("0.5", 0.5), ("0.9", 0.9)])
def test_replay_share_up_to_nine_tenths_is_accepted(value: str, share: float) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_REPLAY_SHARE": value}).replay_share == share


@pytest.mark.parametrize("value", ["0.95", "1", "-0.1", "nan", "a fifth"])
def test_replay_share_out_of_0_to_0_9_is_a_config_error(value: str) -> None:
    # at a share of 1 the replay count round(n * r / (1 - r)) divides by zero
    with pytest.raises(ConfigError, match="TRAINING_REPLAY_SHARE"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_REPLAY_SHARE": value})


@pytest.mark.parametrize(("value", "seconds"), [("0", 0), ("3600", 3600)])
def test_keep_alive_of_0_to_an_hour_is_accepted(value: str, seconds: int) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_KEEP_ALIVE_S": value}).keep_alive_s == seconds


@pytest.mark.parametrize("value", ["3601", "-1"])
def test_keep_alive_beyond_sagemaker_s_hour_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_KEEP_ALIVE_S"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_KEEP_ALIVE_S": value})


@pytest.mark.parametrize(("name", "value"), [
    pytest.param("TRAINING_INSTANCE_COUNT", "0", id="no-instances"),  # template: MinValue 1
    pytest.param("TRAINING_GPUS_PER_INSTANCE", "-1", id="negative-gpus"),  # template: MinValue 0
])
def test_training_count_out_of_its_range_is_a_config_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TrainingSettings.from_env({**TRAINING_ENV, name: value})


def test_kms_key_is_kept_as_given() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV).kms_key == "arn:aws:kms:us-east-1:123456789012:key/1234abcd"


# --- training: the run plan -------------------------------------------------------------------------

PLAN = json.dumps([
    {"name": "256", "instance_count": 4, "hyperparameters": {"resolution": "256", "steps": 50000}},
    {"name": "512", "instance_type": "ml.p4d.24xlarge", "instance_count": 8, "hyperparameters": {"resolution": "512"}},
])


@pytest.mark.parametrize("raw", ["", "[]"])
def test_empty_run_plan_is_one_stage_of_the_base_settings(raw: str) -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": raw})

    assert settings.run_plan == (PlannedJob("main", "ml.p5.48xlarge", 2, {"steps": "100000", "batch-size": "32"}),)
    assert settings.run_plan[0].steps == 100000


def test_run_plan_stages_override_instances_and_hyperparameters() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "64", "TRAINING_RUN_PLAN": PLAN})

    assert settings.run_plan == (
        PlannedJob("256", "ml.p5.48xlarge", 4, {"steps": "50000", "batch-size": "32", "resolution": "256"}),
        PlannedJob("512", "ml.p4d.24xlarge", 8, {"steps": "100000", "batch-size": "32", "resolution": "512"}),
    )
    assert [s.steps for s in settings.run_plan] == [50000, 100000]


def test_stage_without_steps_trains_none() -> None:
    assert PlannedJob("s", "ml.p5.48xlarge", 1, {}).steps == 0


@pytest.mark.parametrize("raw", [
    pytest.param("[{", id="not-json"),
    pytest.param('{"name": "256"}', id="object"),
    pytest.param('"256"', id="string"),
    pytest.param('[{"instance_count": 2}]', id="stage-without-name"),
    pytest.param('[{"name": 256}]', id="name-not-a-string"),
    pytest.param('["256"]', id="stage-not-an-object"),
    pytest.param('[{"name": "256"}, {"hyperparameters": {}}]', id="second-stage-without-name"),
])
def test_malformed_run_plan_is_a_config_error_naming_it(raw: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_RUN_PLAN"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": raw})


@pytest.mark.parametrize("stage", [
    pytest.param({"name": "a", "instance_count": "four"}, id="count-not-a-number"),
    pytest.param({"name": "a", "instance_count": 0}, id="count-zero"),
    pytest.param({"name": "a", "hyperparameters": {"betas": [0.9, 0.999]}}, id="nested-hyperparameter"),
    pytest.param({"name": "a", "hyperparameters": ["steps", "1"]}, id="hyperparameters-not-an-object"),
])
def test_malformed_stage_is_a_config_error_naming_the_run_plan(stage: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="TRAINING_RUN_PLAN"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": json.dumps([stage])})


# --- training: quota versus instances and GPUs ----------------------------------------------------

def test_p5_and_p4d_have_eight_gpus() -> None:
    assert (GPUS_PER_INSTANCE["ml.p5.48xlarge"], GPUS_PER_INSTANCE["ml.p4d.24xlarge"]) == (8, 8)


def test_quota_that_does_not_split_evenly_over_the_instances_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="quota of 30 shards does not split evenly over 4 instances"):
        check_sharding(30, PlannedJob("256", "ml.p5.48xlarge", 4, {}), 0)


def test_fewer_shards_per_instance_than_gpus_is_a_config_error_naming_the_minimum_quota() -> None:
    with pytest.raises(ConfigError, match="4 shards per instance for 8 GPUs; "
                                          "raise TrainingQuota to at least 16"):
        check_sharding(8, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "1"}), 0)


def test_loader_workers_need_no_shards_of_their_own() -> None:
    # the loader's workers share batches, not shards: 8 shards serve 8 GPUs with 4 workers each
    check_sharding(8, PlannedJob("256", "ml.p5.48xlarge", 1, {"num-workers": "4"}), 0)


def test_shards_that_do_not_split_evenly_over_an_instance_s_gpus_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="12 shards per instance do not split evenly over 8 GPUs; use a multiple of 16"):
        check_sharding(24, PlannedJob("256", "ml.p5.48xlarge", 2, {}), 0)


@pytest.mark.parametrize(("quota", "stage"), [
    (16, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "1"})),  # 8 per instance, one per GPU
    (32, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "2"})),
    (1, PlannedJob("cpu", "ml.m5.xlarge", 1, {"num-workers": "1"})),  # a type not in the table: one process
    (2, PlannedJob("cpu", "ml.m5.xlarge", 2, {"num-workers": "1"})),
    (4, PlannedJob("cpu", "ml.m5.xlarge", 2, {})),  # no num-workers: the trainer's default of 2
])
def test_quota_with_whole_shards_for_every_gpu_passes(quota: int, stage: PlannedJob) -> None:
    check_sharding(quota, stage, 0)


def test_gpus_per_instance_override_replaces_the_instance_table() -> None:
    check_sharding(4, PlannedJob("256", "ml.p5.48xlarge", 1, {"num-workers": "1"}), 4)
    with pytest.raises(ConfigError, match="at least 2"):
        check_sharding(1, PlannedJob("cpu", "ml.m5.xlarge", 1, {"num-workers": "1"}), 2)


def test_settings_check_every_stage_of_the_run_plan() -> None:
    # 32 shards are enough for 4 p5 instances (8 each) but not for 8 p4d instances (4 each)
    with pytest.raises(ConfigError, match="run-plan job 512: 4 shards per instance for 8 GPUs"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "32", "TRAINING_RUN_PLAN": PLAN})


def test_settings_check_the_base_stage() -> None:
    with pytest.raises(ConfigError, match="raise TrainingQuota to at least 16"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8"})


def test_settings_take_the_gpus_per_instance_override() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8", "TRAINING_GPUS_PER_INSTANCE": "4"})

    assert settings.quota == 8
    with pytest.raises(ConfigError, match="at least 32"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_GPUS_PER_INSTANCE": "16"})


# --- the template gives each function what its settings need --------------------------------------

@pytest.fixture(scope="module")
def expanded() -> Expanded:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # samtranslator asks boto for a region
        return expand(REPO / "template.yaml", IMAGES, "atelier", "us-east-1", "123456789012")


def function_environment(expanded: Expanded, logical_id: str) -> dict[str, str]:
    """The function's variables as CloudFormation would set them (resources by logical id)."""
    resolver = Resolver(expanded.parameters, expanded.conditions, mappings=expanded.mappings, ref=lambda name: name,
                        get_att=lambda name, attribute: f"{name}.{attribute}")
    variables = resolver.resolve(expanded.resources[logical_id]["Properties"]["Environment"]["Variables"])
    return {k: str(v) for k, v in variables.items()}


@pytest.mark.parametrize(("logical_id", "settings"), [
    ("IngestFunction", IngestSettings), ("PackFunction", PackSettings),
    ("StartTrainingFunction", TrainingSettings), ("DeployFunction", DeploySettings),
])
def test_each_function_environment_in_the_template_parses(expanded: Expanded, logical_id: str, settings: Any) -> None:
    assert isinstance(settings.from_env(function_environment(expanded, logical_id)), settings)


def test_the_template_passes_no_setting_that_has_a_default_in_code(expanded: Expanded) -> None:
    functions = [name for name, r in expanded.resources.items() if r["Type"] == "AWS::Lambda::Function"]

    assert len(functions) == 7
    assert {name: sorted(set(function_environment(expanded, name)) & set(DEFAULTS)) for name in functions} \
        == {name: [] for name in functions}


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


def test_the_near_duplicate_thresholds_reach_ingest_and_import_from_their_parameters() -> None:
    # one default, the template's: the settings have none of their own
    assert IngestSettings.__pydantic_fields__["near_duplicate_colour_distance"].is_required()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        expanded = expand(REPO / "template.yaml", {**IMAGES, "NearDuplicateDistance": "2",
                                                   "NearDuplicateColourDistance": "40"}, "atelier", "us-east-1",
                          "123456789012")
    ingest = IngestSettings.from_env(function_environment(expanded, "IngestFunction"))
    imported = ImportSettings.from_env(function_environment(expanded, "ImportFunction")).ingest

    assert [(s.near_duplicate_distance, s.near_duplicate_colour_distance) for s in (ingest, imported)] == [(2, 40)] * 2


def test_template_training_defaults_parse_to_exact_settings(expanded: Expanded) -> None:
    parsed = TrainingSettings.from_env(function_environment(expanded, "StartTrainingFunction"))

    assert (parsed.quota, parsed.max_retries, parsed.lineage, parsed.concurrency, parsed.replay_share,
            parsed.keep_alive_s, parsed.subnets, parsed.security_groups, parsed.kms_key) \
        == (8, 3, "main", "queue", 0.2, 600, (), (), "")
    # progressive resolution 256 -> 512 -> 1024, one job (and one encode job) per stage, over the base hyperparameters
    base = {"learning-rate": "0.0001", "checkpoint-every": "1000", "seed": "0", "model-config": "sd2"}
    assert parsed.encode_instance_type and parsed.run_plan == (
        PlannedJob("256", "ml.p5.48xlarge", 1, {**base, "steps": "200000", "batch-size": "256", "resolution": "256",
                                          "lr-warmup-steps": "10000"}),
        PlannedJob("512", "ml.p5.48xlarge", 1, {**base, "steps": "100000", "batch-size": "64", "resolution": "512",
                                          "gradient-accumulation": "2", "lr-warmup-steps": "1000"}),
        PlannedJob("1024", "ml.p5.48xlarge", 1, {**base, "steps": "50000", "batch-size": "8", "resolution": "1024",
                                           "learning-rate": "0.00005", "lr-warmup-steps": "1000"}))


def test_the_default_run_plan_runs_each_stage_the_fastest_measured_way(expanded: Expanded) -> None:
    """trainer/configs/defaults/fast.json measured the fastest batch and accumulation per preset and resolution:
    the template's default stages use exactly those, so the default job is the measured one."""
    from trainer.speed.fast_defaults import table

    stages = TrainingSettings.from_env(function_environment(expanded, "StartTrainingFunction")).run_plan
    measured = {(stage.hyperparameters["model-config"], int(stage.hyperparameters["resolution"])): stage for stage in stages}
    matched = [key for key in measured if key in table()]
    assert matched == [("sd2", 256), ("sd2", 512)]  # 1024 is not measured for sd2 yet: it runs eager, batch 8
    for key in matched:
        fast, hyperparameters = table()[key], measured[key].hyperparameters
        assert (int(hyperparameters["batch-size"]), int(hyperparameters.get("gradient-accumulation", "1"))) \
            == (fast.batch_size, fast.gradient_accumulation), key


# --- training: a stage's resolution, by its model preset -------------------------------------------

@pytest.mark.parametrize("encode_instance_type", ["", "ml.g5.2xlarge"])
def test_a_stage_off_its_preset_s_size_multiple_is_refused_before_any_job(encode_instance_type: str) -> None:
    # 520 is a multiple of 8 (the VAE's downsampling) but not of sd2's 64 (VAE x UNet downsampling)
    plan = json.dumps([{"name": "lo", "hyperparameters": {"resolution": "512"}},
                       {"name": "hi", "hyperparameters": {"model-config": "sd2", "resolution": "520"}}])
    with pytest.raises(ConfigError, match="'hi': resolution '520' must be a whole number of pixels, a multiple of 64 "
                                          r"\(model-config 'sd2'"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": encode_instance_type,
                                   "TRAINING_RUN_PLAN": plan})


@pytest.mark.parametrize("preset, resolution", [("sd2", "512"), ("sdxl", "1056"), ("sd3-medium", "528"),
                                                ("pixart-sigma", "1040"), ("tiny-sd3", "40")])
def test_a_stage_on_its_preset_s_size_multiple_is_accepted(preset: str, resolution: str) -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": {"model-config": preset, "resolution": resolution}}])
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan}).run_plan[0].name == "only"


def test_a_model_config_that_is_no_preset_is_refused() -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": {"model-config": "huge"}}])
    with pytest.raises(ConfigError, match="'only': model-config 'huge' is not a preset: pixart-sigma, sd2, sd3-medium"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan})


# --- training: latent shards ----------------------------------------------------------------------

@pytest.mark.parametrize("hyperparameters, refusal", [
    ({"run-config": "sd2-progressive"}, "'hi' sets run-config, several resolutions in one job"),
    ({"resolution": "500"}, "'hi': resolution '500' must be a whole number of pixels, a multiple of 8"),
    ({"resolution": "big"}, "'hi': resolution 'big' must be a whole number"),
])
def test_a_stage_latent_shards_cannot_serve_is_refused_before_any_encode_job(hyperparameters, refusal) -> None:
    plan = json.dumps([{"name": "lo"}, {"name": "hi", "hyperparameters": hyperparameters}])
    with pytest.raises(ConfigError, match=refusal):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge",
                                   "TRAINING_RUN_PLAN": plan})


def test_no_encode_instance_type_trains_on_image_shards() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV).encode_instance_type == ""
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": " "}).encode_instance_type == ""


def test_an_encode_instance_type_is_read() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge"})

    assert settings.encode_instance_type == "ml.g5.2xlarge"


def test_random_crops_on_latent_shards_are_a_config_error_naming_the_stage() -> None:
    plan = json.dumps([{"name": "lo"}, {"name": "hi", "hyperparameters": {"random-crop": "true"}}])

    with pytest.raises(ConfigError, match="'hi' asks for random-crop"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge",
                                   "TRAINING_RUN_PLAN": plan})
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan}).run_plan[1].name == "hi"
