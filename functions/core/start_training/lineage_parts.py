"""A lineage's own model parts, each made once by a helper job before the lineage's first training job
when the base brings none: its VAE (core.start_training.autoencoder_job, `<job>-ae`) and its caption
tokenizers (core.start_training.tokenizer_job, `<job>-tok`). Whether a lineage makes each is decided at its
first claim and recorded on the lineage and on every job it claims; core.start_training.starter asks `missing`
before it starts a claimed job's encode or training job, and calls `store` when a helper job ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from contracts import pipeline_table
from core.start_training.settings import TrainingSettings
from core.start_training import autoencoder_job, tokenizer_job
from core.start_training.job_records import Inputs, model_artifact
from core.start_training.job_requests import autoencoder_job_name, tokenizer_job_name


@dataclass(frozen=True)
class Part:
    role: str  # the helper job record's role, and the claimed job's flag
    field: str  # the Inputs field (and lineage attribute) that holds the part's model.tar.gz
    job_name: Callable[[str], str]  # training job -> helper job
    uri_for: Callable[[str, dict[str, Any], TrainingSettings], str]  # "" until the lineage has it
    begin: Callable[[str, dict[str, Any], Inputs, TrainingSettings], bool]  # False: a job of its name exists
    keep: Callable[[str, str, TrainingSettings], bool]  # create-only on the lineage
    done: str  # the StartDecision actions of its end
    failed: str


def _start_autoencoder(name: str, job: dict[str, Any], inputs: Inputs, settings: TrainingSettings) -> bool:
    return autoencoder_job.start(name, job, inputs.manifest_uri, inputs.exclusions_uri, inputs.pretrained_uri, settings,
                                 inputs.indexes_uri)


def _start_tokenizer(name: str, job: dict[str, Any], inputs: Inputs, settings: TrainingSettings) -> bool:
    return tokenizer_job.start(name, job, inputs.manifest_uri, inputs.exclusions_uri, settings, inputs.indexes_uri)


PARTS = (
    Part(autoencoder_job.ROLE, "vae_uri", autoencoder_job_name, autoencoder_job.vae_for, _start_autoencoder,
         autoencoder_job.store_vae, "autoencoded", "autoencoder-failed"),
    Part(tokenizer_job.ROLE, "tokenizer_uri", tokenizer_job_name, tokenizer_job.tokenizer_for, _start_tokenizer,
         tokenizer_job.store_tokenizer, "tokenized", "tokenizer-failed"),
)


def part_of(role: str | None) -> Part | None:
    """The part a helper job of this role makes (None: not a part's job)."""
    return next((part for part in PARTS if part.role == role), None)


def missing(name: str, job: dict[str, Any], inputs: Inputs, settings: TrainingSettings) -> tuple[Inputs, Part | None]:
    """The job's inputs with the lineage's parts it has, and the first part it still waits for (None: none)."""
    for part in PARTS:
        if job.get(part.role):
            inputs = replace(inputs, **{part.field: part.uri_for(name, job, settings)})
            if not getattr(inputs, part.field):
                return inputs, part
    return inputs, None


def store(part: Part, job: dict[str, Any], status: str, reason: str | None, settings: TrainingSettings) -> str:
    """A part's job ended: Completed with a model.tar.gz, the lineage keeps it (create-only: a redelivered
    event changes nothing) and "" is returned; otherwise why its training job fails."""
    name = pipeline_table.job_name(job["pk"])
    uri = model_artifact(name) if status == "Completed" else ""
    if not uri:
        why = "no ModelArtifacts" if status == "Completed" else reason or "no reason given"
        return f"{part.role} job {name} {status}: {why}"
    part.keep(name, uri, settings)
    return ""
