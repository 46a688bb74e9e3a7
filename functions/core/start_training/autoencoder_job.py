"""A lineage's own VAE: the autoencoder job that trains it, and where the lineage keeps it.

Decided once per lineage, at its first claim (`needs_autoencoder`): when the base (PretrainedModelUri)
brings no VAE, the lineage's first job waits for an autoencoder job `<job>-ae` (the training image
with task=autoencoder, trainer/jobs/autoencoder.py) on that job's image shards. Its model.tar.gz becomes
the lineage's `vae_uri` (create-only: a lineage's VAE never changes, or the UNet's latent space would
move), and every encode and training job of the lineage reads it as the channel `vae`. core.start_training.starter
sequences these steps; this module holds what they do to the table and to SageMaker.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger

from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.job_records import keep_part, part_needed, record_part_job, recorded_part
from core.start_training.job_requests import autoencoder_job_name, autoencoder_job_request
from core.start_training.pretrained import PretrainedBase, split_uri

logger = Logger(child=True)
ROLE = "autoencoder"  # the job record's role (an encode job's is "encode")


def needs_autoencoder(lineage: dict[str, Any], base: PretrainedBase | None, settings: TrainingSettings) -> bool:
    """Whether the lineage trains its own VAE (a lineage that trained without one keeps its latent space)."""
    return part_needed(lineage, "autoencoder", bool(settings.autoencoder_instance_type) and not (base and base.has_vae))


def vae_for(name: str, job: dict[str, Any], settings: TrainingSettings) -> str:
    """The lineage's VAE for a job that needs one, recorded on the job when it first learns it;
    "" while the lineage has none yet (its autoencoder job has not completed)."""
    return recorded_part(name, job, settings, "vae_uri", "autoencoder_job")


def validation_uri(settings: TrainingSettings) -> str:
    """The held-out evaluation shards, when there are any (SageMaker fails a job on an empty channel)."""
    if not settings.eval_data_uri:
        return ""
    bucket, prefix = split_uri(settings.eval_data_uri)
    return settings.eval_data_uri if next(aws.list_objects(bucket, prefix), None) else ""


def start(training_job: str, job: dict[str, Any], manifest_uri: str, exclusions_uri: str, pretrained_uri: str,
          settings: TrainingSettings, indexes_uri: str = "") -> bool:
    """Record and create the training job's autoencoder job; False when one of its name exists."""
    name = autoencoder_job_name(training_job)
    record_part_job(name, ROLE, training_job, settings)
    request = autoencoder_job_request(training_job, manifest_uri, job["digest"], int(job.get("stage", 0)), settings,
                                      exclusions_uri, pretrained_uri=pretrained_uri,
                                      validation_uri=validation_uri(settings), indexes_uri=indexes_uri)
    if aws.create_training_job(request):
        logger.info("autoencoder job started", extra={"job": name, "training_job": training_job})
        return True
    return False


def store_vae(name: str, vae_uri: str, settings: TrainingSettings) -> bool:
    """The lineage's VAE, once: False when it has one already (that one stays)."""
    stored = keep_part(name, vae_uri, settings, "vae_uri", "autoencoder_job")
    if stored:
        logger.info("lineage VAE trained", extra={"job": name, "vae": vae_uri})
    return stored
