"""A training job's record in the pipeline table, as the start-training stage claims it, carries it
to the next run-plan job and reads it back: what its jobs read, and the steps it trains up to."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from contracts import pipeline_table, s3_layout
from contracts.messages import Manifest
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.pretrained import PretrainedBase

# what a run-plan job's record does not inherit from the one before it: that one's end and outputs
NOT_CARRIED = frozenset({"settled", "failure_reason", "model_data", "latents", "latent_indexes"})


def claimed_job(manifest: Manifest, name: str, queue: bool, steps_done: int, autoencoder: bool,
                base: PretrainedBase | None, settings: TrainingSettings, tokenizer: bool = False) -> dict[str, Any]:
    """The record a claim creates for the manifest's first job (run-plan job 0)."""
    return {**pipeline_table.job_item(name, s3_layout.manifest_key(name), [s.shard_id for s in manifest.new_shards],
                                      _now()),
            "status": "Queued" if queue else "Requested", "lineage": settings.lineage, "digest": manifest.digest,
            "stage": 0, "base": name, "steps_base": steps_done,
            "replay": [s.shard_id for s in manifest.shards if s.role == "replay"],
            "sequence": manifest.sequence, "excludes": manifest.excluded,
            "indexes": any(s.table_key for s in manifest.shards),  # manifests.write_files wrote its indexes manifest
            # decided once: a settings change never strands a claimed job
            "encode": bool(settings.encode_instance_type), "autoencoder": autoencoder, "tokenizer": tokenizer,
            "pretrained": base.model_dump_json() if base else ""}


def record_end(job: dict[str, Any], status: str, reason: str | None, table: str) -> bool:
    """A job's end on its record, once: False when an earlier delivery recorded it."""
    return aws.update_item(table, job["pk"], "SET settled = :s, #st = :status, failure_reason = :r",
                           {":s": status, ":status": status, ":r": reason or ""},
                           condition="attribute_not_exists(settled)", names={"#st": "status"})


def next_planned_job_name(job: dict[str, Any], plan_index: int) -> str:
    return f"{job['base']}-s{plan_index}"


def next_planned_job(job: dict[str, Any], plan_index: int) -> dict[str, Any]:
    """The record of the manifest's run-plan job `plan_index`: the same manifest and lineage, its own instances."""
    carried = {k: v for k, v in job.items() if k not in NOT_CARRIED}
    return {**carried, "pk": pipeline_table.job_pk(next_planned_job_name(job, plan_index)), "status": "Requested",
            "stage": plan_index, "at": _now()}


def steps_target(job: dict[str, Any], plan_index: int, settings: TrainingSettings) -> int:
    """The lineage total of steps the run-plan job `plan_index` trains up to."""
    return int(job.get("steps_base", 0)) + sum(s.steps for s in settings.run_plan[:plan_index + 1])


def first_step(job: dict[str, Any], plan_index: int, settings: TrainingSettings) -> int:
    """The lineage step the run-plan job `plan_index` starts at: its warm-up counts from it."""
    return int(job.get("steps_base", 0)) + sum(s.steps for s in settings.run_plan[:plan_index]) + 1


@dataclass(frozen=True)
class Inputs:
    """What a claimed job's jobs read: its manifest's shards, their sample tables and exclusions, and its model parts."""

    manifest_uri: str
    exclusions_uri: str
    pretrained_uri: str  # the base it was claimed with ("": none)
    vae_uri: str = ""  # the lineage's VAE, once its autoencoder job has made one
    tokenizer_uri: str = ""  # the lineage's tokenizers, once its tokenizer job has learned them
    indexes_uri: str = ""  # the ManifestFile of its shards' sample tables ("": none has one)


def inputs_of(name: str, job: dict[str, Any], settings: TrainingSettings) -> Inputs:
    """The manifest files of the manifest's first job (every run-plan job trains on them)."""
    base = job.get("base", name)
    return Inputs(s3_layout.uri(settings.data_bucket, s3_layout.manifest_key(base, s3_layout.MANIFEST_FILE)),
                  s3_layout.uri(settings.data_bucket, s3_layout.manifest_key(base)) if job.get("excludes") else "",
                  PretrainedBase.model_validate_json(job["pretrained"]).uri if job.get("pretrained") else "",
                  indexes_uri=s3_layout.uri(settings.data_bucket, s3_layout.manifest_key(base, s3_layout.INDEXES_MANIFEST))
                  if job.get("indexes") else "")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
