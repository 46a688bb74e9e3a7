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
            "pretrained": base.model_dump_json() if base else "", **recipe_fields(settings)}


def recipe_fields(settings: TrainingSettings) -> dict[str, str]:
    """Which recipe a job was started with (its digest, and where it lies): on its record, and as its tag."""
    return {"recipe": settings.recipe_digest, "recipe_uri": settings.recipe_uri}


def record_end(job: dict[str, Any], status: str, reason: str | None, table: str) -> bool:
    """A job's end on its record, once: False when an earlier delivery recorded it."""
    return aws.update_item(table, job["pk"], "SET settled = :s, #st = :status, failure_reason = :r",
                           {":s": status, ":status": status, ":r": reason or ""},
                           condition="attribute_not_exists(settled)", names={"#st": "status"})


def next_planned_job_name(job: dict[str, Any], plan_index: int) -> str:
    return f"{job['base']}-s{plan_index}"


def next_planned_job(job: dict[str, Any], plan_index: int, settings: TrainingSettings) -> dict[str, Any]:
    """The record of the manifest's run-plan job `plan_index`: the same manifest and lineage, its own instances,
    the recipe current when it is recorded."""
    carried = {k: v for k, v in job.items() if k not in NOT_CARRIED}
    return {**carried, "pk": pipeline_table.job_pk(next_planned_job_name(job, plan_index)), "status": "Requested",
            "stage": plan_index, "at": _now(), **recipe_fields(settings)}


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


# --- a lineage's own parts (its VAE, its tokenizers): the table side both helper jobs share --------------

def part_needed(lineage: dict[str, Any], flag: str, wanted: bool) -> bool:
    """Whether the lineage makes a part (`flag`: "autoencoder", "tokenizer"): as recorded at its first claim,
    else `wanted` now; a lineage that trained before this was decided keeps training without it."""
    if flag in lineage:
        return bool(lineage[flag])
    if int(lineage.get("sequence", 0)) > 0:
        return False
    return wanted


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


def record_part_job(name: str, role: str, training_job: str, settings: TrainingSettings) -> None:
    """The helper job's record, before it is created (a redelivered event finds it and adds nothing)."""
    aws.put_item_if_absent(settings.table, {
        "pk": pipeline_table.job_pk(name), "kind": "job", "role": role, "for_job": training_job, "status": "Requested",
        "lineage": settings.lineage, "at": _now()})


def keep_part(name: str, uri: str, settings: TrainingSettings, uri_field: str, job_field: str) -> bool:
    """The lineage's part, once (create-only): False when it has one already (that one stays)."""
    return aws.update_item(settings.table, pipeline_table.lineage_pk(settings.lineage),
                           f"SET {uri_field} = :u, {job_field} = :j", {":u": uri, ":j": name},
                           condition=f"attribute_not_exists({uri_field})")


def model_artifact(name: str) -> str:
    """A job's model.tar.gz (DescribeTrainingJob's ModelArtifacts); "" without one."""
    described = aws.describe_training_job(name) or {}
    return str(described.get("ModelArtifacts", {}).get("S3ModelArtifacts", ""))
