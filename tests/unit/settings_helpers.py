"""The environments the stage settings tests parse, and the template's, shared by tests/unit/test_settings*.py and
the tests that build settings from every variable the template requires."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier.local.template import Expanded, Resolver, expand
from core.ingest.images import DecodePolicy
from core.deploy.settings import DeploySettings
from core.ingest.settings import DecodePolicyEnv, IngestSettings
from core.pack.settings import PackSettings
from core.redrive.settings import RedriveSettings
from core.sweep.settings import SweepSettings
from core.start_training.settings import TrainingSettings
from tests.support import IMAGES

REPO = Path(__file__).resolve().parents[2]


def tuning_knobs() -> set[str]:
    """The variables the settings give a default of their own (the template passes none of them)."""
    knobs = set()
    for cls in (IngestSettings, DecodePolicyEnv, PackSettings, TrainingSettings, DeploySettings, SweepSettings,
                RedriveSettings):
        knobs |= {field.validation_alias for field in cls.__pydantic_fields__.values()
                  if not field.is_required() and isinstance(field.validation_alias, str)
                  and field.validation_alias not in cls.optional}
    return knobs


DEFAULTS = tuning_knobs()
TRAINING_ENV = {
    "PIPELINE_TABLE": "atelier-PipelineTable",
    "DATA_BUCKET": "atelier-data",
    "MODELS_BUCKET": "atelier-models",
    "TRAINING_QUOTA": "16",  # 8 shards for each of the two instances' 8 GPUs
    "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
    "TRAINING_IMAGE_URI": "atelier-trainer:latest",
    "TRAINING_INSTANCE_TYPE": "ml.p5.48xlarge",
    "TRAINING_INSTANCE_COUNT": "2",
    "TRAINING_TOKENIZER_INSTANCE_TYPE": "ml.g5.2xlarge",  # no base: the hosts share a tokenizer job's tokenizers
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

