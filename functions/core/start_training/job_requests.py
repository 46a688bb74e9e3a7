"""CreateTrainingJob requests of the start-training stage: the training job, its encode job and the
lineage's autoencoder job (the protocol that orders them is core.start_training.starter's; docs/training-jobs.md).

Every job reads its `train` channel (a ManifestFile, FastFile, ShardedByS3Key), where they have them
its shards' sample tables as `indexes` (a ManifestFile, FastFile, FullyReplicated: each instance
sees every table and fetches only those of the shards it was given, which it opens), and, where it has
one, the manifest's exclusion list as `manifest`. Model parts come in as channels too, since jobs run
network-isolated: the base (PretrainedModelUri) as `pretrained` with the hyperparameter
`pretrained=pretrained`, and the lineage's own VAE (its autoencoder job's model.tar.gz) as `vae`
with `vae=vae`. `model_inputs` gives the encode and the training job the same pair, so latents are
encoded with the VAE the UNet then trains on.
"""

from __future__ import annotations

from typing import Any

from contracts import job_tags, s3_layout
from contracts.container_paths import CHECKPOINT_LOCAL_PATH, TENSORBOARD_LOCAL_PATH
from contracts.metrics import AUTOENCODER_METRIC_DEFINITIONS, METRIC_DEFINITIONS
from contracts.recipe import PLANNED_JOB_CONTAINER_HYPERPARAMETERS
from contracts.recipe_jobs import AutoencoderOptions, EncodeOptions, TokenizerOptions
from core.start_training.run_plan import PlannedJob
from core.start_training.settings import TrainingSettings
from core.start_training.instance_types import has_instance_store
from core.start_training.pretrained import AUTOENCODER_SUFFIX, TOKENIZER_SUFFIX

CHANNEL = "train"
MANIFEST_CHANNEL = "manifest"  # the manifest JSON itself, for its exclusion list (only when it has one)
# The shards' sample tables (contracts.shard_index), so no job walks a tar at start. A channel of its own,
# not entries of the `train` manifest: ShardedByS3Key splits a manifest's objects over the instances with
# no promise to keep a tar and its table together.
INDEXES_CHANNEL = "indexes"
PRETRAINED_CHANNEL = "pretrained"  # the base: a diffusers pipeline (or some of its folders), or its model.tar.gz
VAE_CHANNEL = "vae"  # the lineage's autoencoder: its model.tar.gz
TOKENIZER_CHANNEL = "tokenizer"  # the lineage's tokenizer job's model.tar.gz: the pipeline's tokenizer folders
VALIDATION_CHANNEL = "validation"  # the held-out evaluation shards (the autoencoder job's PSNR)
ENCODE_SUFFIX = "-enc"
# the run-plan job's hyperparameters trainer/jobs/encode.py shares with trainer/jobs/train.py (its latents depend on them),
# and the container's own settings (trainer/container.py) it runs with too: the recipe marks them (contracts.recipe_jobs)
ENCODE_HYPERPARAMETERS = (*EncodeOptions.training_job_flags(), *PLANNED_JOB_CONTAINER_HYPERPARAMETERS)
# ... and those trainer/jobs/autoencoder.py takes from the run-plan job (training.autoencoder_hyperparameters add the rest)
AUTOENCODER_PLANNED_JOB_HYPERPARAMETERS = (*AutoencoderOptions.training_job_flags(), *PLANNED_JOB_CONTAINER_HYPERPARAMETERS)
# ... and those trainer/jobs/tokenizer.py takes (the preset names the text encoders its tokenizers serve)
TOKENIZER_PLANNED_JOB_HYPERPARAMETERS = (*TokenizerOptions.training_job_flags(), *PLANNED_JOB_CONTAINER_HYPERPARAMETERS)


def planned_job_hyperparameters(planned: PlannedJob, steps_target: int, first_step: int = 1) -> dict[str, str]:
    """The run-plan job's hyperparameters, with `steps` as the lineage total this job trains up to
    (checkpoints are shared by the lineage, so a follow-up job resumes at the steps already done) and,
    past the lineage's first step, `first-step`, the step the run-plan job starts at: its warm-up counts from there."""
    hyperparameters = {**planned.hyperparameters, "steps": str(steps_target)}
    if first_step > 1:
        hyperparameters["first-step"] = str(first_step)
    return hyperparameters


def file_channel(name: str, uri: str, content_type: str = "") -> dict[str, Any]:
    """An S3Prefix channel every instance gets whole, as files: a prefix's objects keep their paths
    below it, a single key (a model.tar.gz) lands as that one file."""
    channel: dict[str, Any] = {"ChannelName": name, "InputMode": "File", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}
    if content_type:
        channel["ContentType"] = content_type
    return channel


def indexes_channel(uri: str) -> dict[str, Any]:
    """The `indexes` channel: the ManifestFile `uri` of the shards' sample tables."""
    return {"ChannelName": INDEXES_CHANNEL, "InputMode": "FastFile", "ContentType": "application/octet-stream",
            "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile", "S3Uri": uri,
                                            "S3DataDistributionType": "FullyReplicated"}}}


def model_inputs(pretrained_uri: str, vae_uri: str, tokenizer_uri: str = "") -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The channels and hyperparameters that bring a job its pretrained parts (any may be empty)."""
    channels, hyperparameters = [], {}
    for name, uri in ((PRETRAINED_CHANNEL, pretrained_uri), (VAE_CHANNEL, vae_uri), (TOKENIZER_CHANNEL, tokenizer_uri)):
        if uri:
            channels.append(file_channel(name, uri))
            hyperparameters[name] = name  # the trainer resolves a channel name to /opt/ml/input/data/<name>
    return channels, hyperparameters


def _job_request(name: str, train_uri: str, hyperparameters: dict[str, str], instances: tuple[str, int],
                 output_prefix: str, checkpoint_uri: str, tags: dict[str, str], settings: TrainingSettings,
                 exclusions_uri: str = "", channels: list[dict[str, Any]] | None = None,
                 metrics: list[dict[str, str]] | None = None, indexes_uri: str = "") -> dict[str, Any]:
    """What every job's request shares: the `train` channel, then the `manifest` channel (with
    `exclusions_uri`, the manifest JSON: trainer.jobs.train, encode and autoencoder --manifest), the
    `indexes` channel (with `indexes_uri`: --index-dir), then `channels`; checkpoints, retries,
    isolation, VPC and KMS."""
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": settings.role_arn,
        "AlgorithmSpecification": {"TrainingImage": settings.image_uri, "TrainingInputMode": "FastFile"},
        "HyperParameters": hyperparameters,
        "InputDataConfig": [{
            "ChannelName": CHANNEL,
            "InputMode": "FastFile",
            "ContentType": "application/x-tar",
            "DataSource": {"S3DataSource": {
                "S3DataType": "ManifestFile", "S3Uri": train_uri,
                "S3DataDistributionType": "ShardedByS3Key",
            }},
        }],
        "OutputDataConfig": {"S3OutputPath": f"s3://{settings.models_bucket}/{output_prefix}"},
        "ResourceConfig": {"InstanceType": instances[0], "InstanceCount": instances[1],
                           "VolumeSizeInGB": settings.volume_gb},
        "StoppingCondition": {"MaxRuntimeInSeconds": settings.max_runtime_s},
        "CheckpointConfig": {"S3Uri": checkpoint_uri, "LocalPath": CHECKPOINT_LOCAL_PATH},
        "RetryStrategy": {"MaximumRetryAttempts": settings.max_retries},
        "EnableNetworkIsolation": True,
        "EnableInterContainerTrafficEncryption": True,
        "Tags": [{"Key": key, "Value": value} for key, value in tags.items()],
    }
    if metrics:
        request["AlgorithmSpecification"]["MetricDefinitions"] = metrics
    if exclusions_uri:
        request["InputDataConfig"].append(file_channel(MANIFEST_CHANNEL, exclusions_uri, "application/json"))
    if indexes_uri:
        request["InputDataConfig"].append(indexes_channel(indexes_uri))
    request["InputDataConfig"].extend(channels or [])
    if settings.keep_alive_s:
        request["ResourceConfig"]["KeepAlivePeriodInSeconds"] = settings.keep_alive_s
    if settings.subnets:
        request["VpcConfig"] = {"Subnets": list(settings.subnets), "SecurityGroupIds": list(settings.security_groups)}
    encrypt_with_key(request, settings.kms_key)
    return request


def encrypt_with_key(request: dict[str, Any], kms_key: str) -> None:
    """The job's outputs, and its ML storage volume unless it is instance store, for which AWS
    refuses a VolumeKmsKeyId (core/start_training/instance_types.py): the hardware encrypts those."""
    if not kms_key:
        return
    request["OutputDataConfig"]["KmsKeyId"] = kms_key
    if not has_instance_store(request["ResourceConfig"]["InstanceType"]):
        request["ResourceConfig"]["VolumeKmsKeyId"] = kms_key


def _planned_job_tags(manifest_digest: str, plan_index: int, settings: TrainingSettings) -> dict[str, str]:
    return {job_tags.MANIFEST: manifest_digest, job_tags.LINEAGE: settings.lineage,
            job_tags.PLANNED_JOB: settings.run_plan[plan_index].name,
            job_tags.FINAL_PLANNED_JOB: str(plan_index == len(settings.run_plan) - 1).lower(),
            **({job_tags.RECIPE: settings.recipe_digest} if settings.recipe_digest else {})}


def _helper_tags(training_job: str, role: str, manifest_digest: str, plan_index: int,
                 settings: TrainingSettings) -> dict[str, str]:
    """An encode or autoencoder job's: its training job's, never final, with its role and that job."""
    return {**_planned_job_tags(manifest_digest, plan_index, settings), job_tags.FINAL_PLANNED_JOB: "false", job_tags.ROLE: role,
            job_tags.TRAINING_JOB: training_job}


def _base(pretrained_uri: str | None, settings: TrainingSettings) -> str:
    # None: the settings' base (trainer.launch); the pipeline passes the one the job was claimed with
    return settings.pretrained_uri if pretrained_uri is None else pretrained_uri


def training_job_request(name: str, manifest_uri: str, manifest_digest: str, plan_index: int,
                         steps_target: int, settings: TrainingSettings, exclusions_uri: str = "", *,
                         pretrained_uri: str | None = None, vae_uri: str = "", first_step: int = 1,
                         indexes_uri: str = "", compile_cache: list[dict[str, Any]] | None = None,
                         tokenizer_uri: str = "") -> dict[str, Any]:
    """CreateTrainingJob's request; `manifest_uri` lists image shards or their latent twins (and
    `indexes_uri`, if any, their sample tables), and `exclusions_uri` (if any) is the manifest JSON for
    the `manifest` channel. The job trains the lineage's steps `first_step` to `steps_target`.
    `compile_cache`: the shared compiled shapes' channel, where there is one (core.start_training.compile_caches.channels)."""
    planned = settings.run_plan[plan_index]
    channels, model_hyperparameters = model_inputs(_base(pretrained_uri, settings), vae_uri, tokenizer_uri)
    channels += compile_cache or []
    request = _job_request(
        name, manifest_uri, {**planned_job_hyperparameters(planned, steps_target, first_step), **model_hyperparameters},
        (planned.instance_type, planned.instance_count), s3_layout.TRAINING,
        # One prefix per lineage: a retried job and the lineage's next job resume from it.
        s3_layout.uri(settings.models_bucket, s3_layout.checkpoint_prefix(settings.lineage)),
        _planned_job_tags(manifest_digest, plan_index, settings), settings, exclusions_uri, channels, METRIC_DEFINITIONS,
        indexes_uri)
    # The trainer writes its event files to LocalPath (trainer/runtime/tensorboard_log.py); SageMaker's
    # TensorBoard app and `atelier tensorboard JOB` read them from the job's own prefix.
    request["TensorBoardOutputConfig"] = {"S3OutputPath": tensorboard_uri(settings.models_bucket, name),
                                          "LocalPath": TENSORBOARD_LOCAL_PATH}
    return request


def tensorboard_uri(models_bucket: str, job: str) -> str:
    return s3_layout.uri(models_bucket, s3_layout.tensorboard_prefix(job))


def encode_job_name(training_job: str) -> str:
    return f"{training_job}{ENCODE_SUFFIX}"


def encode_job_request(training_job: str, manifest_uri: str, manifest_digest: str, plan_index: int,
                       settings: TrainingSettings, exclusions_uri: str = "", *, pretrained_uri: str | None = None,
                       vae_uri: str = "", indexes_uri: str = "", tokenizer_uri: str = "") -> dict[str, Any]:
    """The training image with task=encode on one encode instance, for the run-plan job's resolution and
    models; its latent shards reach S3 through CheckpointConfig (trainer/jobs/encode.py). It reads the
    training job's `manifest` channel (`exclusions_uri`): excluded samples are never encoded."""
    planned = settings.run_plan[plan_index]
    channels, model_hyperparameters = model_inputs(_base(pretrained_uri, settings), vae_uri, tokenizer_uri)
    hyperparameters = {"task": "encode", **{k: v for k, v in planned.hyperparameters.items() if k in ENCODE_HYPERPARAMETERS},
                       **model_hyperparameters}
    return _job_request(encode_job_name(training_job), manifest_uri, hyperparameters,
                        (settings.encode_instance_type, 1), s3_layout.ENCODED,
                        s3_layout.uri(settings.models_bucket, s3_layout.encoded_prefix(training_job)),
                        _helper_tags(training_job, "encode", manifest_digest, plan_index, settings), settings,
                        exclusions_uri, channels, indexes_uri=indexes_uri)  # no loss to chart: no metrics


def autoencoder_job_name(training_job: str) -> str:
    return f"{training_job}{AUTOENCODER_SUFFIX}"


def autoencoder_job_request(training_job: str, manifest_uri: str, manifest_digest: str, plan_index: int,
                            settings: TrainingSettings, exclusions_uri: str = "", *, pretrained_uri: str | None = None,
                            validation_uri: str = "", indexes_uri: str = "") -> dict[str, Any]:
    """The training image with task=autoencoder on one instance (trainer/jobs/autoencoder.py): a VAE trained
    on the training job's image shards, less its exclusions, its PSNR measured on `validation_uri`
    (the held-out evaluation shards). One checkpoint prefix per lineage, so a retried job resumes."""
    planned = settings.run_plan[plan_index]
    base = _base(pretrained_uri, settings)
    channels, model_hyperparameters = model_inputs(base, "")  # a base here holds no VAE, maybe a text encoder
    if validation_uri:
        channels.insert(0, file_channel(VALIDATION_CHANNEL, validation_uri))
    hyperparameters = {**{k: v for k, v in planned.hyperparameters.items() if k in AUTOENCODER_PLANNED_JOB_HYPERPARAMETERS},
                       **settings.autoencoder_hyperparameters, **model_hyperparameters, "task": "autoencoder"}
    return _job_request(autoencoder_job_name(training_job), manifest_uri, hyperparameters,
                        (settings.autoencoder_instance_type, 1), s3_layout.AUTOENCODER,
                        s3_layout.uri(settings.models_bucket, s3_layout.checkpoint_prefix(
                            f"{settings.lineage}{AUTOENCODER_SUFFIX}")),
                        _helper_tags(training_job, "autoencoder", manifest_digest, plan_index, settings), settings,
                        exclusions_uri, channels, AUTOENCODER_METRIC_DEFINITIONS, indexes_uri)


def tokenizer_job_name(training_job: str) -> str:
    return f"{training_job}{TOKENIZER_SUFFIX}"


def tokenizer_job_request(training_job: str, manifest_uri: str, manifest_digest: str, plan_index: int,
                          settings: TrainingSettings, exclusions_uri: str = "", indexes_uri: str = "") -> dict[str, Any]:
    """The training image with task=tokenizer on one instance (trainer/jobs/tokenizer.py): the tokenizers the
    run-plan job's model-config needs, learned from the captions of the training job's shards less its exclusions.
    No model channel: a tokenizer is learned from captions alone."""
    planned = settings.run_plan[plan_index]
    hyperparameters = {**{k: v for k, v in planned.hyperparameters.items() if k in TOKENIZER_PLANNED_JOB_HYPERPARAMETERS},
                       "task": "tokenizer"}
    return _job_request(tokenizer_job_name(training_job), manifest_uri, hyperparameters,
                        (settings.tokenizer_instance_type, 1), s3_layout.TOKENIZERS,
                        s3_layout.uri(settings.models_bucket, s3_layout.checkpoint_prefix(
                            f"{settings.lineage}{TOKENIZER_SUFFIX}")),
                        _helper_tags(training_job, job_tags.TOKENIZER, manifest_digest, plan_index, settings), settings,
                        exclusions_uri, indexes_uri=indexes_uri)
