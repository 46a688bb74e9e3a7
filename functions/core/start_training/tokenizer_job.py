"""A lineage's own caption tokenizers: the tokenizer job that learns them, and where the lineage keeps them.

Decided once per lineage, at its first claim (`needs_tokenizer`): when the base (PretrainedModelUri)
brings no tokenizer, the lineage's first job waits for a tokenizer job `<job>-tok` (the training image
with task=tokenizer, trainer/jobs/tokenizer.py) on that job's image shards. Its model.tar.gz (the
pipeline's tokenizer folders) becomes the lineage's `tokenizer_uri` (create-only: a lineage's token ids
never change, or its frozen text encoders would read other captions), and every encode and training job of
the lineage reads it as the channel `tokenizer`. core.start_training.lineage_parts sequences it beside the
autoencoder job; this module holds what it does to the table and to SageMaker.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger

from contracts import job_tags
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import tokenizer_job_name, tokenizer_job_request
from core.start_training.job_records import keep_part, part_needed, record_part_job, recorded_part
from core.start_training.pretrained import PretrainedBase

logger = Logger(child=True)
ROLE = job_tags.TOKENIZER  # the job record's role and its tag's, and the claimed job's flag


def needs_tokenizer(lineage: dict[str, Any], base: PretrainedBase | None, settings: TrainingSettings) -> bool:
    """Whether the lineage learns its own tokenizers (a lineage that trained without them keeps its token ids)."""
    return part_needed(lineage, "tokenizer", bool(settings.tokenizer_instance_type) and not (base and base.has_tokenizer))


def tokenizer_for(name: str, job: dict[str, Any], settings: TrainingSettings) -> str:
    """The lineage's tokenizers for a job that needs them, recorded on the job when it first learns
    them; "" while the lineage has none yet (its tokenizer job has not completed)."""
    return recorded_part(name, job, settings, "tokenizer_uri", "tokenizer_job")


def start(training_job: str, job: dict[str, Any], manifest_uri: str, exclusions_uri: str, settings: TrainingSettings,
          indexes_uri: str = "") -> bool:
    """Record and create the training job's tokenizer job; False when one of its name exists."""
    name = tokenizer_job_name(training_job)
    record_part_job(name, ROLE, training_job, settings)
    request = tokenizer_job_request(training_job, manifest_uri, job["digest"], int(job.get("stage", 0)), settings,
                                    exclusions_uri, indexes_uri)
    if aws.create_training_job(request):
        logger.info("tokenizer job started", extra={"job": name, "training_job": training_job})
        return True
    return False


def store_tokenizer(name: str, tokenizer_uri: str, settings: TrainingSettings) -> bool:
    """The lineage's tokenizers, once: False when it has them already (those stay)."""
    stored = keep_part(name, tokenizer_uri, settings, "tokenizer_uri", "tokenizer_job")
    if stored:
        logger.info("lineage tokenizer learned", extra={"job": name, "tokenizer": tokenizer_uri})
    return stored
