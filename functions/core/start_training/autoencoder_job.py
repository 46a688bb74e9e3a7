"""A lineage's own VAE: the autoencoder job that trains it, and where the lineage keeps it.

Decided once per lineage, at its first claim (`needs_autoencoder`): when the base (PretrainedModelUri)
brings no VAE, the lineage's first job waits for an autoencoder job `<job>-ae` (the training image
with task=autoencoder, trainer/jobs/autoencoder.py) on that job's image shards. Its model.tar.gz becomes
the lineage's `vae_uri` (create-only: a lineage's VAE never changes, or the UNet's latent space would
move), and every encode and training job of the lineage reads it as the channel `vae`. core.start_training.starter
sequences these steps; this module holds what they do to the table and to SageMaker.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import autoencoder_job_name, autoencoder_job_request
from core.start_training.pretrained import PretrainedBase, split_uri

logger = Logger(child=True)
ROLE = "autoencoder"  # the job record's role (an encode job's is "encode")


def needs_autoencoder(lineage: dict[str, Any], base: PretrainedBase | None, settings: TrainingSettings) -> bool:
    """Whether the lineage trains its own VAE: as recorded at its first claim, else decided now."""
    if "autoencoder" in lineage:
        return bool(lineage["autoencoder"])
    if int(lineage.get("sequence", 0)) > 0:  # it trained before this was decided: its latent space stays
        return False
    return bool(settings.autoencoder_instance_type) and not (base and base.has_vae)


def vae_for(name: str, job: dict[str, Any], settings: TrainingSettings) -> str:
    """The lineage's VAE for a job that needs one, recorded on the job when it first learns it;
    "" while the lineage has none yet (its autoencoder job has not completed)."""
    return recorded_part(name, job, settings, "vae_uri", "autoencoder_job")


def recorded_part(name: str, job: dict[str, Any], settings: TrainingSettings, uri_field: str, job_field: str) -> str:
    """A lineage part's URI (`uri_field`: its VAE, its tokenizers) for job `name`: the job's own record, else the
    lineage's, then written on the job once (create-only, with the part's job `job_field`); "" while the lineage
    has none yet."""
    if job.get(uri_field):
        return str(job[uri_field])
    lineage = aws.get_item(settings.table, pipeline_table.lineage_pk(settings.lineage)) or {}
    if not lineage.get(uri_field):
        return ""
    aws.update_item(settings.table, pipeline_table.job_pk(name), f"SET {uri_field} = :u, {job_field} = :j",
                    {":u": lineage[uri_field], ":j": lineage.get(job_field, "")},
                    condition=f"attribute_exists(pk) AND attribute_not_exists({uri_field})")
    return str(lineage[uri_field])


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
    aws.put_item_if_absent(settings.table, {
        "pk": pipeline_table.job_pk(name), "kind": "job", "role": ROLE, "for_job": training_job, "status": "Requested",
        "lineage": settings.lineage, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    request = autoencoder_job_request(training_job, manifest_uri, job["digest"], int(job.get("stage", 0)), settings,
                                      exclusions_uri, pretrained_uri=pretrained_uri,
                                      validation_uri=validation_uri(settings), indexes_uri=indexes_uri)
    if aws.create_training_job(request):
        logger.info("autoencoder job started", extra={"job": name, "training_job": training_job})
        return True
    return False


def artefact(name: str) -> str:
    """The autoencoder job's model.tar.gz (DescribeTrainingJob's ModelArtifacts); "" without one."""
    described = aws.describe_training_job(name) or {}
    return str(described.get("ModelArtifacts", {}).get("S3ModelArtifacts", ""))


def store_vae(name: str, vae_uri: str, settings: TrainingSettings) -> bool:
    """The lineage's VAE, once: False when it has one already (that one stays)."""
    stored = aws.update_item(settings.table, pipeline_table.lineage_pk(settings.lineage),
                             "SET vae_uri = :u, autoencoder_job = :a",
                             {":u": vae_uri, ":a": name}, condition="attribute_not_exists(vae_uri)")
    if stored:
        logger.info("lineage VAE trained", extra={"job": name, "vae": vae_uri})
    return stored
