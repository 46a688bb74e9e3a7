"""StartTrainingFunction's settings: the quota, the jobs' resources and the run plan, checked before any
job is paid for (core/settings.py says which settings have a default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from contracts import lora_pipelines, model_presets, recipe
from contracts.recipe_jobs import AutoencoderOptions
from core import recipes
from core.errors import ConfigError
from core.settings import StageSettings, given, settings, flat_strings, names
from core.start_training.failure_brake import BrakeSettings
from core.start_training.pretrained import AUTOENCODER_SUFFIX, check_uri
from core.start_training.run_plan import (PlannedJob, check_autoencoder_resolution, check_cuda_graphs, check_encodable,
                                         check_sharding, hyperparameters, parse_run_plan)


@settings
class BaseJob(StageSettings):
    """The instances and hyperparameters every run-plan job starts from (one job, when there is no run plan)."""

    instance_type: str = Field(validation_alias="TRAINING_INSTANCE_TYPE")
    instance_count: int = Field(ge=1, validation_alias="TRAINING_INSTANCE_COUNT")
    hyperparameters: dict[str, str] = Field(validation_alias="TRAINING_HYPERPARAMETERS")

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _hyperparameters(cls, raw: Any) -> dict[str, str]:
        return hyperparameters(flat_strings(raw, "TRAINING_HYPERPARAMETERS"), "TRAINING_HYPERPARAMETERS")


@settings
class TrainingSettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    data_bucket: str = Field(validation_alias="DATA_BUCKET")
    models_bucket: str = Field(validation_alias="MODELS_BUCKET")
    quota: int = Field(ge=1, validation_alias="TRAINING_QUOTA")
    role_arn: str = Field(validation_alias="SAGEMAKER_ROLE_ARN")
    image_uri: str = Field(validation_alias="TRAINING_IMAGE_URI")
    volume_gb: int = Field(200, validation_alias="TRAINING_VOLUME_GB")  # a tuning knob, as below
    max_runtime_s: int = Field(432000, validation_alias="TRAINING_MAX_RUNTIME_S")  # SageMaker's longest, 5 days
    max_retries: int = Field(3, ge=1, le=30, validation_alias="TRAINING_MAX_RETRIES")
    lineage: str = Field(validation_alias="TRAINING_LINEAGE")
    # "queue": claim the next manifest while a job runs; "skip": wait
    concurrency: Literal["queue", "skip"] = Field("queue", validation_alias="TRAINING_CONCURRENCY")
    # share of a follow-up job's shards drawn from shards trained before, so old skills stay
    replay_share: float = Field(0.2, ge=0.0, le=0.9, validation_alias="TRAINING_REPLAY_SHARE")
    # SageMaker warm pool (billed while kept) so a chained run-plan job or the next job starts fast
    keep_alive_s: int = Field(600, ge=0, le=3600, validation_alias="TRAINING_KEEP_ALIVE_S")
    subnets: tuple[str, ...] = Field((), validation_alias="TRAINING_SUBNETS")
    security_groups: tuple[str, ...] = Field((), validation_alias="TRAINING_SECURITY_GROUPS")
    kms_key: str = Field("", validation_alias="TRAINING_KMS_KEY")
    run_plan: tuple[PlannedJob, ...]  # one job each, chained; from TRAINING_HYPERPARAMETERS and TRAINING_RUN_PLAN
    # what the models are for; partner terms may allow only some uses (core.partners.licensing)
    use: Literal["commercial", "research"] = Field(validation_alias="TRAINING_USE")
    # An encode job (trainer/jobs/encode.py) on this instance type turns each job's image shards into
    # latent shards before the job trains; empty: the job trains on the image shards (VAE online).
    encode_instance_type: str = Field("", validation_alias="TRAINING_ENCODE_INSTANCE_TYPE")
    # Pretrained parts (core.start_training.pretrained): the `pretrained` channel of every encode and training job;
    # empty: every part is built at random from the job's model-config.
    pretrained_uri: str = Field("", validation_alias="TRAINING_PRETRAINED_MODEL_URI")
    # Where a lineage gets no VAE from its base, an autoencoder job on this instance type trains one
    # before its first job (core.start_training.autoencoder_job); empty: no autoencoder job (the frozen VAE is random).
    autoencoder_instance_type: str = Field("", validation_alias="TRAINING_AUTOENCODER_INSTANCE_TYPE")
    autoencoder_hyperparameters: dict[str, str] = Field(default_factory=dict, validation_alias="TRAINING_AUTOENCODER_HYPERPARAMETERS")
    # Where a lineage gets no tokenizer from its base, a tokenizer job on this instance type learns one from
    # its first job's captions (core.start_training.tokenizer_job); the template sets it from AutoencoderInstanceType.
    tokenizer_instance_type: str = Field("", validation_alias="TRAINING_TOKENIZER_INSTANCE_TYPE")
    eval_data_uri: str = Field("", validation_alias="TRAINING_EVAL_DATA_URI")  # the autoencoder job's `validation`
    # backoff and circuit breaker on failing jobs (core.start_training.failure_brake)
    # failed jobs in a row (capacity errors not counted) that halt a lineage until `atelier lineage resume`
    max_consecutive_failures: int = Field(3, ge=1, validation_alias="TRAINING_MAX_CONSECUTIVE_FAILURES")
    # the wait after a lineage's first failed job; it doubles with each failure in a row (at most 6 hours)
    failure_backoff_s: int = Field(600, ge=0, validation_alias="TRAINING_FAILURE_BACKOFF_S")
    gpus_per_instance: int = Field(0, ge=0, validation_alias="TRAINING_GPUS_PER_INSTANCE")  # 0: by instance type
    # the recipe the run plan and the autoencoder's hyperparameters came from (contracts.recipe_file), recorded on
    # the lineage, each job's record and each job's tags
    recipe_uri: str = Field("", validation_alias="RECIPE_URI")
    recipe_digest: str = Field("", validation_alias="RECIPE_DIGEST")

    optional: ClassVar[frozenset[str]] = frozenset({
        "TRAINING_SUBNETS", "TRAINING_SECURITY_GROUPS", "TRAINING_KMS_KEY", "TRAINING_RUN_PLAN",
        "TRAINING_ENCODE_INSTANCE_TYPE", "TRAINING_PRETRAINED_MODEL_URI", "TRAINING_AUTOENCODER_INSTANCE_TYPE",
        "TRAINING_AUTOENCODER_HYPERPARAMETERS", "TRAINING_TOKENIZER_INSTANCE_TYPE", "TRAINING_EVAL_DATA_URI",
        "RECIPE_URI", "RECIPE_DIGEST"})

    @classmethod
    def current(cls, env: Mapping[str, str] | None = None) -> "TrainingSettings":
        """The settings the function decides with: its environment and the current recipe (core.recipes)."""
        return cls.from_env(recipes.with_current(env))

    @model_validator(mode="before")
    @classmethod
    def _from_variables(cls, values: Any) -> Any:
        """The run plan, from the base hyperparameters, the run plan's JSON and the base instances."""
        values = given(values)
        if not isinstance(values, dict):
            return values
        if "run_plan" not in values:
            base = BaseJob.from_env(values)  # what each run-plan job overrides
            values["run_plan"] = parse_run_plan(values.get("TRAINING_RUN_PLAN", ""), base.hyperparameters,
                                                PlannedJob("main", base.instance_type, base.instance_count, {}))
        return values

    @field_validator("subnets", "security_groups", mode="before")
    @classmethod
    def _names(cls, raw: Any) -> Any:
        return names(raw) if isinstance(raw, str) else raw

    @field_validator("encode_instance_type", "autoencoder_instance_type", "tokenizer_instance_type",
                     "eval_data_uri", "kms_key")
    @classmethod
    def _stripped(cls, raw: str) -> str:
        return raw.strip()

    @field_validator("pretrained_uri")
    @classmethod
    def _pretrained_uri(cls, raw: str) -> str:
        """empty, a base's s3:// prefix, or the s3:// key of its model.tar.gz."""
        return check_uri(raw.strip(), "TRAINING_PRETRAINED_MODEL_URI (PretrainedModelUri)") if raw.strip() else ""

    @field_validator("autoencoder_hyperparameters", mode="before")
    @classmethod
    def _autoencoder(cls, raw: Any) -> dict[str, str]:
        name = "TRAINING_AUTOENCODER_HYPERPARAMETERS"
        return hyperparameters(flat_strings(raw, name), name)

    @field_validator("lineage")
    @classmethod
    def _lineage(cls, lineage: str) -> str:
        if lineage.endswith(AUTOENCODER_SUFFIX):
            raise ValueError(f"TRAINING_LINEAGE={lineage!r} must not end in {AUTOENCODER_SUFFIX!r}: lineage X "
                             f"keeps its autoencoder's checkpoints at checkpoints/X{AUTOENCODER_SUFFIX}/")
        return lineage

    @property
    def brake(self) -> BrakeSettings:
        backoff = self.failure_backoff_s
        return BrakeSettings(max_failures=self.max_consecutive_failures, backoff_s=backoff,
                             max_backoff_s=max(backoff, BrakeSettings.max_backoff_s))

    @property
    def lora_jobs(self) -> tuple[str, ...]:
        """The run-plan jobs that train a LoRA (`train: lora`): the base's pipeline must be able to load it."""
        return tuple(job.name for job in self.run_plan if lora_pipelines.trains_lora(job.hyperparameters))

    def check(self) -> None:
        """Every run-plan job, checked as the trainer would check it, before any job is paid for."""
        if bool(self.subnets) != bool(self.security_groups):
            raise ConfigError("TRAINING_SUBNETS and TRAINING_SECURITY_GROUPS go together (a VPC config needs both)")
        added = {"pretrained": "pretrained"} if self.pretrained_uri else {}  # core.start_training.job_requests.model_inputs
        for job in self.run_plan:
            check_sharding(self.quota, job, self.gpus_per_instance)
            if refusal := model_presets.resolution_refusal(job.hyperparameters):
                raise ConfigError(f"run-plan job {job.name!r}: {refusal}")
            if refusal := recipe.refusal(job.hyperparameters, added=added):
                raise ConfigError(f"run-plan job {job.name!r}: {refusal}")
            if self.encode_instance_type:
                check_encodable(job)
            check_cuda_graphs(job, self.gpus_per_instance)
            if job.instance_count > 1 and not self.tokenizer_instance_type and not self.pretrained_uri:
                # without a base's or a tokenizer job's, each host would learn its own from its own shards
                # (trainer/jobs/train.py refuses that at its start)
                raise ConfigError(f"run-plan job {job.name!r} runs on {job.instance_count} instances with no tokenizer: "
                                  "no base (PretrainedModelUri) brings one and no tokenizer job learns one (set "
                                  "TRAINING_TOKENIZER_INSTANCE_TYPE, AutoencoderInstanceType in the template)")
        if self.autoencoder_instance_type and (
                refusal := recipe.refusal(self.autoencoder_hyperparameters, AutoencoderOptions)):
            raise ConfigError(f"TRAINING_AUTOENCODER_HYPERPARAMETERS: {refusal}")
        if self.autoencoder_instance_type:
            for job in self.run_plan:
                check_autoencoder_resolution(job, self.autoencoder_hyperparameters)
