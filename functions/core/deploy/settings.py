"""DeployFunction's settings: the evaluation job, the gate, the rollout and the model server's environment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from core import recipes
from core.settings import StageSettings, settings, flat_strings, names
from core.start_training.run_plan import hyperparameters


@settings
class DeploySettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    role_arn: str = Field(validation_alias="SAGEMAKER_ROLE_ARN")
    image_uri: str = Field(validation_alias="INFERENCE_IMAGE_URI")  # the inference image
    endpoint_name: str = Field(validation_alias="ENDPOINT_NAME")
    instance_type: str = Field(validation_alias="ENDPOINT_INSTANCE_TYPE")
    # the evaluation job (the training image run with task=evaluate)
    training_image_uri: str = Field(validation_alias="TRAINING_IMAGE_URI")
    eval_instance_type: str = Field(validation_alias="EVAL_INSTANCE_TYPE")
    eval_data_uri: str = Field(validation_alias="EVAL_DATA_URI")  # s3://bucket/prefix/ of the held-out shards
    clip_model_uri: str = Field("", validation_alias="CLIP_MODEL_URI")  # a CLIP model for the CLIP score; empty: none
    eval_hyperparameters: dict[str, str] = Field(default_factory=dict, validation_alias="EVAL_HYPERPARAMETERS")
    models_bucket: str = Field(validation_alias="MODELS_BUCKET")
    max_eval_runtime_s: int = Field(ge=60, le=432000, validation_alias="MAX_EVAL_RUNTIME_S")
    # the gate (core.deploy.gate)
    gate_max_loss: float = Field(ge=0.0, validation_alias="GATE_MAX_LOSS")
    gate_max_loss_ratio: float = Field(ge=0.0, validation_alias="GATE_MAX_LOSS_RATIO")
    gate_min_clip_delta: float = Field(ge=0.0, validation_alias="GATE_MIN_CLIP_DELTA")
    # the rollout
    rollback_alarms: tuple[str, ...] = Field((), validation_alias="ROLLBACK_ALARMS")
    traffic_routing: Literal["ALL_AT_ONCE", "CANARY", "LINEAR"] = Field("CANARY", validation_alias="TRAFFIC_ROUTING")
    # share of capacity for the canary (or each linear step); SageMaker allows at most 50 (a tuning knob, as below)
    canary_percent: int = Field(10, ge=1, le=50, validation_alias="CANARY_PERCENT")
    # each canary or linear step is watched this long; the old fleet is kept this long after the shift
    wait_interval_s: int = Field(300, ge=0, le=3600, validation_alias="WAIT_INTERVAL_S")
    bake_s: int = Field(600, ge=0, le=3600, validation_alias="BAKE_S")
    max_rollout_s: int = Field(ge=600, le=28800, validation_alias="MAX_ROLLOUT_S")
    min_instances: int = Field(1, ge=1, validation_alias="MIN_INSTANCES")  # autoscaling's bounds
    max_instances: int = Field(4, ge=1, validation_alias="MAX_INSTANCES")
    # autoscaling's target, invocations per instance per minute
    invocations_per_instance: int = Field(60, ge=1, validation_alias="INVOCATIONS_PER_INSTANCE")
    kms_key: str = Field("", validation_alias="KMS_KEY_ARN")
    # how long a new endpoint instance may take to answer /ping 200: the server compiles the UNet and
    # the VAE decoder before it does (trainer/serve/generation.py; 102 s on an H200, bench/RESULTS.md);
    # 60..3600 is AWS's range for the variant's field
    startup_timeout_s: int = Field(1200, ge=60, le=3600, validation_alias="ENDPOINT_STARTUP_TIMEOUT_S")
    # the model server's $SERVE_* settings, in every model's container (contracts/serve_environment.py)
    serve_environment: dict[str, str] = Field(default_factory=dict, validation_alias="SERVE_ENVIRONMENT")
    # the Secrets Manager secret (ARN) the model server signs its PNGs with (contracts/c2pa_secret.py); empty: unsigned
    signing_secret_arn: str = Field("", validation_alias="C2PA_SIGNING_SECRET_ARN")
    # the recipe the gate, the evaluation job and the server's environment came from (contracts.recipe_file)
    recipe_uri: str = Field("", validation_alias="RECIPE_URI")
    recipe_digest: str = Field("", validation_alias="RECIPE_DIGEST")

    optional: ClassVar[frozenset[str]] = frozenset({
        "CLIP_MODEL_URI", "EVAL_HYPERPARAMETERS", "ROLLBACK_ALARMS", "KMS_KEY_ARN", "SERVE_ENVIRONMENT",
        "C2PA_SIGNING_SECRET_ARN", "RECIPE_URI", "RECIPE_DIGEST"})

    @field_validator("rollback_alarms", mode="before")
    @classmethod
    def _names(cls, raw: Any) -> Any:
        return names(raw) if isinstance(raw, str) else raw

    @field_validator("eval_hyperparameters", mode="before")
    @classmethod
    def _eval(cls, raw: Any) -> dict[str, str]:
        return hyperparameters(flat_strings(raw, "EVAL_HYPERPARAMETERS"), "EVAL_HYPERPARAMETERS")

    @field_validator("serve_environment", mode="before")
    @classmethod
    def _serve_environment(cls, raw: Any) -> dict[str, str]:
        return recipes.serve_settings(raw, "SERVE_ENVIRONMENT")

    @classmethod
    def current(cls, env: Mapping[str, str] | None = None) -> "DeploySettings":
        """The settings the function decides with: its environment and the current recipe (core.recipes)."""
        return cls.from_env(recipes.with_current(env))

