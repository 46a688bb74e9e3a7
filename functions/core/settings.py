"""Typed settings, parsed once from the environment that template.yaml gives each function."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Mapping

from contracts import model_presets, recipe, serve_environment
from contracts.recipe_jobs import AutoencoderOptions
from core.errors import ConfigError
from core.ingest.images import KNOWN_FORMATS, DecodePolicy
from core.pack.lanes import MAX_LANES
from core.redrive.dead_letters import CONTRACTS, RedrivePolicy
from core.start_training.failure_brake import BrakeSettings
from core.start_training.instance_types import GPUS_PER_INSTANCE
from core.start_training.pretrained import AUTOENCODER_SUFFIX, check_uri


# Tuning knobs rather than deploy-time choices: template.yaml passes none of them and each takes this
# default, unless its environment variable is set (tests set some; so may `sam local invoke --env-vars`).
DEFAULTS: dict[str, str] = {
    "MAX_IMAGE_PIXELS": "178956970",  # Pillow's own decompression-bomb limit, stated outright
    "MAX_SIDECAR_BYTES": "65536",  # a larger sidecar .json is refused (bad_sidecar); at most this much is read
    "MAX_SIDECAR_DEPTH": "4",  # JSON nesting above which a sidecar is refused (bad_sidecar)
    "ALPHA_BACKGROUND": "255,255,255",  # R,G,B that transparent pixels are composited over
    "SWEEP_LOOKBACK_S": "86400",  # the sweep looks at uploads this recent; older ones are `atelier audit`'s
    "SWEEP_MAX_QUEUE_DEPTH": "1000",  # a sweep run is deferred while UploadsQueue holds more (ingest is behind)
    "DEAD_LETTER_MEMORY_S": "86400",  # a redrive count untouched this long is forgotten (a new incident)
}


def _require(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "") or DEFAULTS.get(name, "")
    if not value:
        raise ConfigError(f"environment variable {name} is not set (template.yaml sets it)")
    return value


def _int(env: Mapping[str, str], name: str) -> int:
    raw = _require(env, name)
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc


def _float(env: Mapping[str, str], name: str) -> float:
    raw = _require(env, name)
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a number") from exc
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    return value


def _bounded(name: str, value: float, low: float, high: float = math.inf) -> float:
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is outside {low}..{high}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = _require(env, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {choices}")
    return value


def _formats(raw: str) -> frozenset[str]:
    formats = frozenset(f.strip().lower() for f in raw.split(",") if f.strip())
    unknown = formats - set(KNOWN_FORMATS.values())
    if unknown or not formats:
        raise ConfigError(f"ALLOWED_FORMATS={raw!r}: unknown {sorted(unknown)}; known {sorted(set(KNOWN_FORMATS.values()))}")
    return formats


def _rgb(raw: str) -> tuple[int, int, int]:
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) <= 255 for p in parts):
        raise ConfigError(f"ALPHA_BACKGROUND={raw!r} is not 'R,G,B' with values 0..255")
    r, g, b = (int(p) for p in parts)
    return r, g, b


def _near_distance(value: int) -> int:
    # Four 16-bit bands find every hash within 3 bits (pigeonhole); beyond that some are missed.
    if not 0 <= value <= 3:
        raise ConfigError(f"NEAR_DUPLICATE_DISTANCE={value} must be 0..3 (the band index finds at most 3)")
    return value


@dataclass(frozen=True)
class IngestSettings:
    table: str
    pack_queue_url: str
    data_bucket: str  # where re-encoded derivatives are stored
    max_upload_bytes: int
    decode: DecodePolicy
    min_short_side: int
    max_aspect_ratio: float
    jpeg_quality: int
    near_duplicate_distance: int
    # Input limits besides bytes and pixels (docs/reliability.md): the sidecar's in DEFAULTS, the caption's
    # from template.yaml.
    max_sidecar_bytes: int = 65536
    max_sidecar_depth: int = 4
    max_caption_chars: int = 2000
    # A sidecar whose image is still missing this long after it was written is an orphan (core.ingest.sidecars).
    sidecar_orphan_grace_s: int = 3600
    # Near duplicates' colour signatures differ by at most this many levels (core.ingest.dedup); from_env
    # requires it (template.yaml's NearDuplicateColourDistance), the default is that parameter's.
    near_duplicate_colour_distance: int = 16
    pack_lanes: int = 1  # the lane an accepted sample's record is given (core.pack.lanes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "IngestSettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            pack_queue_url=_require(env, "PACK_QUEUE_URL"),
            data_bucket=_require(env, "DATA_BUCKET"),
            max_upload_bytes=int(_bounded("MAX_UPLOAD_BYTES", _int(env, "MAX_UPLOAD_BYTES"), 1)),
            decode=DecodePolicy(
                allowed=_formats(_require(env, "ALLOWED_FORMATS")),
                max_pixels=int(_bounded("MAX_IMAGE_PIXELS", _int(env, "MAX_IMAGE_PIXELS"), 1)),
                background=_rgb(_require(env, "ALPHA_BACKGROUND")),
                max_side=int(_bounded("STORE_MAX_SIDE", _int(env, "STORE_MAX_SIDE"), 16)),
                reencode=_choice(env, "REENCODE", ("auto", "always")),
            ),
            min_short_side=int(_bounded("MIN_SHORT_SIDE", _int(env, "MIN_SHORT_SIDE"), 1)),
            max_aspect_ratio=_bounded("MAX_ASPECT_RATIO", _float(env, "MAX_ASPECT_RATIO"), 1.0),
            jpeg_quality=int(_bounded("STORE_JPEG_QUALITY", _int(env, "STORE_JPEG_QUALITY"), 50, 100)),
            near_duplicate_distance=_near_distance(_int(env, "NEAR_DUPLICATE_DISTANCE")),
            max_sidecar_bytes=int(_bounded("MAX_SIDECAR_BYTES", _int(env, "MAX_SIDECAR_BYTES"), 2, 1 << 20)),
            max_sidecar_depth=int(_bounded("MAX_SIDECAR_DEPTH", _int(env, "MAX_SIDECAR_DEPTH"), 1, 64)),
            max_caption_chars=int(_bounded("MAX_CAPTION_CHARS", _int(env, "MAX_CAPTION_CHARS"), 1, 100_000)),
            sidecar_orphan_grace_s=_orphan_grace(env),
            near_duplicate_colour_distance=int(_bounded(
                "NEAR_DUPLICATE_COLOUR_DISTANCE", _int(env, "NEAR_DUPLICATE_COLOUR_DISTANCE"), 0, 255)),
            pack_lanes=_lanes(_int(env, "PACK_LANES")),
        )


@dataclass(frozen=True)
class PackSettings:
    table: str
    data_bucket: str
    event_bus: str
    shard_target_bytes: int  # a shard is sealed before it would grow past this
    shard_max_samples: int
    shard_max_age_s: int  # ... or once its first segment is this old
    lanes: int = 1  # open shards packed side by side (core.pack.lanes)
    # How long a seal is leased to the invocation finishing it (core.pack.journal.claim_seal): the
    # handler sets the invocation's remaining time; 900 s is Lambda's longest.
    seal_lease_s: float = 900.0
    # S3's rules and the packer's memory, not deployment choices (tests lower them to keep moto fast).
    min_part_bytes: int = 5 << 20  # S3's smallest part but the last
    part_bytes: int = 16 << 20  # the one part a streaming upload holds in memory

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "PackSettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            data_bucket=_require(env, "DATA_BUCKET"),
            event_bus=_require(env, "EVENT_BUS_NAME"),
            shard_target_bytes=_int(env, "SHARD_TARGET_BYTES"),
            shard_max_samples=_int(env, "SHARD_MAX_SAMPLES"),
            shard_max_age_s=_int(env, "SHARD_MAX_AGE_S"),
            lanes=_lanes(_int(env, "PACK_LANES")),
        )


def _lanes(count: int) -> int:
    if not 1 <= count <= MAX_LANES:
        raise ConfigError(f"PACK_LANES={count}: must be 1..{MAX_LANES}")
    return count




@dataclass(frozen=True)
class PlannedJob:
    """One job of a run plan: its instances and the hyperparameters it overrides."""

    name: str
    instance_type: str
    instance_count: int
    hyperparameters: dict[str, str]

    @property
    def steps(self) -> int:
        return int(self.hyperparameters.get("steps", "0"))


@dataclass(frozen=True)
class TrainingSettings:
    table: str
    data_bucket: str
    models_bucket: str
    quota: int
    role_arn: str
    image_uri: str
    volume_gb: int
    max_runtime_s: int
    max_retries: int
    lineage: str
    concurrency: str  # "queue": claim the next manifest while a job runs; "skip": wait
    replay_share: float
    keep_alive_s: int
    subnets: tuple[str, ...]
    security_groups: tuple[str, ...]
    kms_key: str
    run_plan: tuple[PlannedJob, ...]  # its jobs, chained; a plain run is one job
    use: str = "commercial"  # what the models are for; partner terms may allow only some uses (core.partners.licensing)
    # An encode job (trainer/jobs/encode.py) on this instance type turns each run-plan job's image shards into
    # latent shards before the job trains; empty: the job trains on the image shards (VAE online).
    encode_instance_type: str = ""
    # Pretrained parts (core.start_training.pretrained): the `pretrained` channel of every encode and training job;
    # empty: every part is built at random from the run-plan job's model-config.
    pretrained_uri: str = ""
    # Where a lineage gets no VAE from its base, an autoencoder job on this instance type trains one
    # before its first job (core.start_training.autoencoder_job); empty: no autoencoder job (the frozen VAE is random).
    autoencoder_instance_type: str = ""
    autoencoder_hyperparameters: dict[str, str] = field(default_factory=dict)
    # Where a lineage gets no tokenizer from its base, a tokenizer job on this instance type learns one from
    # its first job's captions (core.start_training.tokenizer_job); the template sets it from AutoencoderInstanceType.
    tokenizer_instance_type: str = ""
    eval_data_uri: str = ""  # s3://<data>/<EvalDataPrefix>: the autoencoder job's `validation` channel
    brake: BrakeSettings = BrakeSettings()  # backoff and circuit breaker on failing jobs (core.start_training.failure_brake)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "TrainingSettings":
        base = _hyperparameters(_require(env, "TRAINING_HYPERPARAMETERS"))
        default_job = PlannedJob("main", _require(env, "TRAINING_INSTANCE_TYPE"),
                                 int(_bounded("TRAINING_INSTANCE_COUNT", _int(env, "TRAINING_INSTANCE_COUNT"), 1)), {})
        settings = cls(
            table=_require(env, "PIPELINE_TABLE"),
            data_bucket=_require(env, "DATA_BUCKET"),
            models_bucket=_require(env, "MODELS_BUCKET"),
            quota=int(_bounded("TRAINING_QUOTA", _int(env, "TRAINING_QUOTA"), 1)),
            role_arn=_require(env, "SAGEMAKER_ROLE_ARN"),
            image_uri=_require(env, "TRAINING_IMAGE_URI"),
            volume_gb=_int(env, "TRAINING_VOLUME_GB"),
            max_runtime_s=_int(env, "TRAINING_MAX_RUNTIME_S"),
            max_retries=int(_bounded("TRAINING_MAX_RETRIES", _int(env, "TRAINING_MAX_RETRIES"), 1, 30)),
            lineage=_require(env, "TRAINING_LINEAGE"),
            concurrency=_choice(env, "TRAINING_CONCURRENCY", ("queue", "skip")),
            replay_share=_bounded("TRAINING_REPLAY_SHARE", _float(env, "TRAINING_REPLAY_SHARE"), 0.0, 0.9),
            keep_alive_s=int(_bounded("TRAINING_KEEP_ALIVE_S", _int(env, "TRAINING_KEEP_ALIVE_S"), 0, 3600)),
            subnets=_list(env.get("TRAINING_SUBNETS", "")),
            security_groups=_list(env.get("TRAINING_SECURITY_GROUPS", "")),
            kms_key=env.get("TRAINING_KMS_KEY", ""),
            run_plan=_run_plan(env.get("TRAINING_RUN_PLAN", "") or "[]", base, default_job),
            use=env.get("TRAINING_USE", "") or "commercial",  # a TrainingUse parameter may set it
            encode_instance_type=env.get("TRAINING_ENCODE_INSTANCE_TYPE", "").strip(),
            pretrained_uri=_pretrained_uri(env.get("TRAINING_PRETRAINED_MODEL_URI", "").strip()),
            autoencoder_instance_type=env.get("TRAINING_AUTOENCODER_INSTANCE_TYPE", "").strip(),
            autoencoder_hyperparameters=_hyperparameters(env.get("TRAINING_AUTOENCODER_HYPERPARAMETERS") or "{}",
                                                         "TRAINING_AUTOENCODER_HYPERPARAMETERS"),
            eval_data_uri=env.get("TRAINING_EVAL_DATA_URI", "").strip(),
            tokenizer_instance_type=env.get("TRAINING_TOKENIZER_INSTANCE_TYPE", "").strip(),
            brake=_brake(env),
        )
        if bool(settings.subnets) != bool(settings.security_groups):
            raise ConfigError("TRAINING_SUBNETS and TRAINING_SECURITY_GROUPS go together (a VPC config needs both)")
        if settings.lineage.endswith(AUTOENCODER_SUFFIX):
            raise ConfigError(f"TRAINING_LINEAGE={settings.lineage!r} must not end in {AUTOENCODER_SUFFIX!r}: lineage X "
                              f"keeps its autoencoder's checkpoints at checkpoints/X{AUTOENCODER_SUFFIX}/")
        gpus = int(_bounded("TRAINING_GPUS_PER_INSTANCE", _int(env, "TRAINING_GPUS_PER_INSTANCE"), 0))
        for planned in settings.run_plan:
            check_sharding(settings.quota, planned, gpus)
            if refusal := model_presets.resolution_refusal(planned.hyperparameters):  # before any job is paid for
                raise ConfigError(f"run-plan job {planned.name!r}: {refusal}")
            # every value the trainer would refuse, by its own recipe; the request adds the `pretrained` channel
            if refusal := recipe.refusal(planned.hyperparameters, added=_channels(settings.pretrained_uri, "pretrained")):
                raise ConfigError(f"run-plan job {planned.name!r}: {refusal}")
            if settings.encode_instance_type:
                check_encodable(planned)
        if settings.autoencoder_instance_type and (
                refusal := recipe.refusal(settings.autoencoder_hyperparameters, AutoencoderOptions)):
            raise ConfigError(f"TRAINING_AUTOENCODER_HYPERPARAMETERS: {refusal}")
        return settings


def _channels(uri: str, name: str) -> dict[str, str]:
    """The hyperparameter a job request adds for a channel (core.start_training.job_requests.model_inputs)."""
    return {name: name} if uri else {}


def _brake(env: Mapping[str, str]) -> BrakeSettings:
    backoff = int(_bounded("TRAINING_FAILURE_BACKOFF_S", _int(env, "TRAINING_FAILURE_BACKOFF_S"), 0))
    return BrakeSettings(
        max_failures=int(_bounded("TRAINING_MAX_CONSECUTIVE_FAILURES", _int(env, "TRAINING_MAX_CONSECUTIVE_FAILURES"), 1)),
        backoff_s=backoff, max_backoff_s=max(backoff, BrakeSettings.max_backoff_s))


def _pretrained_uri(raw: str) -> str:
    """TRAINING_PRETRAINED_MODEL_URI: empty, a base's s3:// prefix, or the s3:// key of its model.tar.gz."""
    try:
        return check_uri(raw, "TRAINING_PRETRAINED_MODEL_URI (PretrainedModelUri)") if raw else ""
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _run_plan(raw: str, base: dict[str, str], default: PlannedJob) -> tuple[PlannedJob, ...]:
    """TRAINING_RUN_PLAN: `[{"name", "instance_type"?, "instance_count"?, "hyperparameters"?}, ...]`;
    empty: one job with the base instance settings."""
    try:
        plan = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TRAINING_RUN_PLAN is not JSON: {exc}") from exc
    if not isinstance(plan, list):
        raise ConfigError("TRAINING_RUN_PLAN must be a JSON list of jobs")
    if not plan:
        return (PlannedJob(default.name, default.instance_type, default.instance_count, dict(base)),)
    jobs = []
    for index, item in enumerate(plan):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"TRAINING_RUN_PLAN[{index}] needs a name")
        overrides = _hyperparameters(json.dumps(item.get("hyperparameters", {})),
                                     f"TRAINING_RUN_PLAN[{index}].hyperparameters")
        count = item.get("instance_count", default.instance_count)
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"TRAINING_RUN_PLAN[{index}].instance_count must be a whole number >= 1")
        jobs.append(PlannedJob(item["name"], str(item.get("instance_type", default.instance_type)), count,
                               {**base, **overrides}))
    return tuple(jobs)


def check_encodable(planned: PlannedJob) -> None:
    """Latent shards hold one centred crop per sample at the job's resolution (trainer/jobs/encode.py):
    a run-plan job they cannot serve is refused here, when the function starts, before any encode job is paid for."""
    if planned.hyperparameters.get("random-crop", "false").lower() in {"true", "1", "yes"}:
        raise ConfigError(f"run-plan job {planned.name!r} asks for random-crop, which needs image shards: "
                          "set TRAINING_ENCODE_INSTANCE_TYPE (EncodeInstanceType) empty or drop random-crop")
    if planned.hyperparameters.get("run-config"):
        raise ConfigError(f"run-plan job {planned.name!r} sets run-config, several resolutions in one job, but its encode job "
                          "writes latents at one: give each resolution its own TRAINING_RUN_PLAN job, or set "
                          "TRAINING_ENCODE_INSTANCE_TYPE (EncodeInstanceType) empty to train on image shards")


def check_sharding(quota: int, planned: PlannedJob, gpus_override: int) -> None:
    """ShardedByS3Key gives each instance quota/instances shards; each of its GPUs reads whole
    shards, so it needs at least one, and the same number as its neighbours. The loader's workers
    share a GPU's batches, not its shards (trainer/data/shards.py, loader.py), so they need no shards of their own."""
    gpus = gpus_override or GPUS_PER_INSTANCE.get(planned.instance_type, 1)
    if quota % planned.instance_count:
        raise ConfigError(f"run-plan job {planned.name}: a quota of {quota} shards does not split evenly over "
                          f"{planned.instance_count} instances")
    per_instance = quota // planned.instance_count
    if per_instance < gpus:
        raise ConfigError(f"run-plan job {planned.name}: {per_instance} shards per instance for {gpus} GPUs; "
                          f"raise TrainingQuota to at least {planned.instance_count * gpus}")
    if per_instance % gpus:
        raise ConfigError(f"run-plan job {planned.name}: {per_instance} shards per instance do not split evenly over "
                          f"{gpus} GPUs; use a multiple of {planned.instance_count * gpus}")


@dataclass(frozen=True)
class DeploySettings:
    table: str
    role_arn: str
    image_uri: str  # the inference image
    endpoint_name: str
    instance_type: str
    # the evaluation job (the training image run with task=evaluate)
    training_image_uri: str = ""
    eval_instance_type: str = "ml.g5.xlarge"
    eval_data_uri: str = ""  # s3://bucket/prefix/ of the held-out shards
    clip_model_uri: str = ""  # a CLIP model for the CLIP score; empty: no scorer
    eval_hyperparameters: dict[str, str] = field(default_factory=dict)
    models_bucket: str = ""
    max_eval_runtime_s: int = 3600
    # the gate
    gate_max_loss: float = 1.0
    gate_max_loss_ratio: float = 1.05
    gate_min_clip_delta: float = 0.5
    # the rollout
    rollback_alarms: tuple[str, ...] = ()
    traffic_routing: str = "ALL_AT_ONCE"
    canary_percent: int = 10
    wait_interval_s: int = 300
    bake_s: int = 600
    max_rollout_s: int = 3600
    min_instances: int = 1
    max_instances: int = 2
    invocations_per_instance: int = 60
    kms_key: str = ""
    # how long a new endpoint instance may take to answer /ping 200: the server compiles the UNet and
    # the VAE decoder before it does (trainer/serve/generation.py; 102 s on an H200, bench/RESULTS.md)
    startup_timeout_s: int = 1200
    # the model server's $SERVE_* settings, in every model's container (contracts/serve_environment.py)
    serve_environment: dict[str, str] = field(default_factory=dict)
    # the Secrets Manager secret (ARN) the model server signs its PNGs with (contracts/c2pa_secret.py); empty: unsigned
    signing_secret_arn: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "DeploySettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            role_arn=_require(env, "SAGEMAKER_ROLE_ARN"),
            image_uri=_require(env, "INFERENCE_IMAGE_URI"),
            endpoint_name=_require(env, "ENDPOINT_NAME"),
            instance_type=_require(env, "ENDPOINT_INSTANCE_TYPE"),
            training_image_uri=_require(env, "TRAINING_IMAGE_URI"),
            eval_instance_type=_require(env, "EVAL_INSTANCE_TYPE"),
            eval_data_uri=_require(env, "EVAL_DATA_URI"),
            clip_model_uri=env.get("CLIP_MODEL_URI", ""),
            eval_hyperparameters=_hyperparameters(env.get("EVAL_HYPERPARAMETERS") or "{}", "EVAL_HYPERPARAMETERS"),
            models_bucket=_require(env, "MODELS_BUCKET"),
            max_eval_runtime_s=int(_bounded("MAX_EVAL_RUNTIME_S", _int(env, "MAX_EVAL_RUNTIME_S"), 60, 432000)),
            gate_max_loss=_bounded("GATE_MAX_LOSS", _float(env, "GATE_MAX_LOSS"), 0.0),
            gate_max_loss_ratio=_bounded("GATE_MAX_LOSS_RATIO", _float(env, "GATE_MAX_LOSS_RATIO"), 0.0),
            gate_min_clip_delta=_bounded("GATE_MIN_CLIP_DELTA", _float(env, "GATE_MIN_CLIP_DELTA"), 0.0),
            rollback_alarms=_list(env.get("ROLLBACK_ALARMS", "")),
            traffic_routing=_choice(env, "TRAFFIC_ROUTING", ("ALL_AT_ONCE", "CANARY", "LINEAR")),
            canary_percent=int(_bounded("CANARY_PERCENT", _int(env, "CANARY_PERCENT"), 1, 50)),
            wait_interval_s=int(_bounded("WAIT_INTERVAL_S", _int(env, "WAIT_INTERVAL_S"), 0, 3600)),
            bake_s=int(_bounded("BAKE_S", _int(env, "BAKE_S"), 0, 3600)),
            max_rollout_s=int(_bounded("MAX_ROLLOUT_S", _int(env, "MAX_ROLLOUT_S"), 600, 28800)),
            min_instances=int(_bounded("MIN_INSTANCES", _int(env, "MIN_INSTANCES"), 1)),
            max_instances=int(_bounded("MAX_INSTANCES", _int(env, "MAX_INSTANCES"), 1)),
            invocations_per_instance=int(_bounded("INVOCATIONS_PER_INSTANCE", _int(env, "INVOCATIONS_PER_INSTANCE"), 1)),
            kms_key=env.get("KMS_KEY_ARN", ""),
            startup_timeout_s=int(_bounded("ENDPOINT_STARTUP_TIMEOUT_S", _int(env, "ENDPOINT_STARTUP_TIMEOUT_S"), 60, 3600)),
            serve_environment=_serve_environment(env.get("SERVE_ENVIRONMENT") or "{}"),
            signing_secret_arn=env.get("C2PA_SIGNING_SECRET_ARN", ""),
        )


def _serve_environment(raw: str) -> dict[str, str]:
    """The server's settings as a flat JSON object of its own $SERVE_* names, each value within SageMaker's limit."""
    values = _flat_strings(raw, "SERVE_ENVIRONMENT")
    if unknown := serve_environment.unknown(values):
        raise ConfigError(f"SERVE_ENVIRONMENT: {unknown} are not the model server's settings; "
                          f"it reads {', '.join(sorted(serve_environment.VARIABLES))}")
    if long := sorted(name for name, value in values.items() if len(value) > serve_environment.MAX_VALUE_CHARS):
        raise ConfigError(f"SERVE_ENVIRONMENT: {long} longer than SageMaker's "
                          f"{serve_environment.MAX_VALUE_CHARS} characters")
    try:  # each value as the model server parses it at start
        serve_environment.ServeSettings.from_env(values)
    except ValueError as error:
        raise ConfigError(f"SERVE_ENVIRONMENT: {error}") from error
    return values


# CreateTrainingJob's HyperParameters (botocore's model): 100 entries, keys of 256 and values of 2,500
# characters, each matching `.*`, which (in Java, as in Python) takes no line break
MAX_HYPERPARAMETERS, MAX_HYPERPARAMETER_KEY, MAX_HYPERPARAMETER_VALUE = 100, 256, 2500
LINE_BREAKS = ("\n", "\r", "\u0085", "\u2028", "\u2029")


def _hyperparameters(raw: str, name: str = "TRAINING_HYPERPARAMETERS") -> dict[str, str]:
    """SageMaker hyperparameters: a flat map of strings within CreateTrainingJob's limits, checked when the
    function starts rather than when a job is refused."""
    values = _flat_strings(raw, name)
    if len(values) > MAX_HYPERPARAMETERS:
        raise ConfigError(f"{name} has {len(values)} entries; SageMaker takes at most {MAX_HYPERPARAMETERS}")
    for key, value in values.items():
        if len(key) > MAX_HYPERPARAMETER_KEY or len(value) > MAX_HYPERPARAMETER_VALUE:
            raise ConfigError(f"{name}: {key[:40]!r} is over SageMaker's {MAX_HYPERPARAMETER_KEY} characters a name "
                              f"or {MAX_HYPERPARAMETER_VALUE} a value")
        if any(mark in key + value for mark in LINE_BREAKS):
            raise ConfigError(f"{name}: {key[:40]!r} holds a line break, which SageMaker refuses in a hyperparameter")
    return values


def _flat_strings(raw: str, name: str) -> dict[str, str]:
    """A flat JSON object, its values as strings; anything else refused early."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object")
    nested = sorted(k for k, v in value.items() if isinstance(v, (dict, list)))
    if nested:
        raise ConfigError(f"{name} must be flat; {nested} hold objects or lists")
    return {str(k): str(v) for k, v in value.items()}


@dataclass(frozen=True)
class SweepSettings:
    table: str
    uploads_bucket: str
    uploads_queue_url: str
    grace_s: int  # an upload younger than this may still have its notification on the way
    lookback_s: int  # uploads older than this are the audit's business, not the sweep's
    # UploadsQueue deeper than this: ingest is behind, so uploads without a record are expected and
    # re-driving them would only add duplicates to the backlog; the run is deferred
    max_queue_depth: int = 1000
    # A sidecar still waiting for its image this long after it was written is re-driven, so ingest
    # records it as an orphan (core.ingest.sidecars)
    sidecar_orphan_grace_s: int = 3600

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "SweepSettings":
        grace = int(_bounded("SWEEP_GRACE_S", _int(env, "SWEEP_GRACE_S"), 0))
        depth = _int(env, "SWEEP_MAX_QUEUE_DEPTH")
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            uploads_bucket=_require(env, "UPLOADS_BUCKET"),
            uploads_queue_url=_require(env, "UPLOADS_QUEUE_URL"),
            grace_s=grace,
            lookback_s=int(_bounded("SWEEP_LOOKBACK_S", _int(env, "SWEEP_LOOKBACK_S"), grace + 1)),
            max_queue_depth=int(_bounded("SWEEP_MAX_QUEUE_DEPTH", depth, 1)),
            sidecar_orphan_grace_s=_orphan_grace(env),
        )


def _orphan_grace(env: Mapping[str, str]) -> int:
    """SIDECAR_ORPHAN_GRACE_S (template.yaml's SidecarOrphanGraceSeconds); ImportFunction has no sidecars."""
    value = _int(env, "SIDECAR_ORPHAN_GRACE_S") if env.get("SIDECAR_ORPHAN_GRACE_S") else 3600
    return int(_bounded("SIDECAR_ORPHAN_GRACE_S", value, 0))


@dataclass(frozen=True)
class ImportSettings:
    """ImportFunction: ingest's acceptance policy for every sample, the packer's shard machinery."""

    ingest: IngestSettings
    pack: PackSettings
    chunk_bytes: int = 16 << 20  # accepted samples held before they are written as one segment

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "ImportSettings":
        # An import hands nothing to the pack queue: it writes its shards itself (docs/import.md).
        ingest = IngestSettings.from_env({**env, "PACK_QUEUE_URL": env.get("PACK_QUEUE_URL") or "none",
                                          "PACK_LANES": env.get("PACK_LANES") or "1"})
        pack = PackSettings(table=ingest.table, data_bucket=ingest.data_bucket,
                            event_bus=_require(env, "EVENT_BUS_NAME"), shard_target_bytes=0, shard_max_samples=0,
                            shard_max_age_s=0)  # one imported shard per source tar: no size policy applies
        return cls(ingest=ingest, pack=pack)


@dataclass(frozen=True)
class DeadLetterQueue:
    # Queue names, not URLs: the same on AWS, under moto and in events/env.json (`sam local invoke`)
    name: str
    contract: str  # core.redrive.dead_letters.CONTRACTS: what its messages' consumer parses
    source: str = ""  # the queue it redrives to; empty: it holds events, re-put on the bus


@dataclass(frozen=True)
class RedriveSettings:
    """RedriveFunction: every DLQ of the stack, and the policy that empties them (core.redrive.redriver)."""

    table: str
    event_bus: str
    queues: dict[str, DeadLetterQueue]  # by logical id, e.g. UploadsDLQ
    policy: RedrivePolicy

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RedriveSettings":
        raw = _require(env, "DEAD_LETTER_QUEUES")
        try:
            queues = {name: DeadLetterQueue(name=q["queue"], contract=q["contract"], source=q.get("source", ""))
                      for name, q in json.loads(raw).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"DEAD_LETTER_QUEUES is not a JSON object of {{logical id: {{queue, contract[, source]}}}}: {exc}") from exc
        unknown = {name for name, q in queues.items() if q.contract not in CONTRACTS}
        if unknown:
            raise ConfigError(f"DEAD_LETTER_QUEUES: {sorted(unknown)} name no contract of {sorted(CONTRACTS)}")
        policy = RedrivePolicy(cap=int(_bounded("DEAD_LETTER_REDRIVE_CAP", _int(env, "DEAD_LETTER_REDRIVE_CAP"), 1)),
                               backoff_s=int(_bounded("DEAD_LETTER_BACKOFF_S", _int(env, "DEAD_LETTER_BACKOFF_S"), 0)),
                               memory_s=int(_bounded("DEAD_LETTER_MEMORY_S", _int(env, "DEAD_LETTER_MEMORY_S"), 1)))
        return cls(table=_require(env, "PIPELINE_TABLE"), event_bus=_require(env, "EVENT_BUS_NAME"), queues=queues,
                   policy=policy)
