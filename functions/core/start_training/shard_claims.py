"""A manifest's shards through its job: claimed in one transaction with the job's record and the lineage
lock, then marked trained when the job completes or returned to pending when it does not (the commit
protocol of docs/training-jobs.md; core.start_training.starter decides when)."""

from __future__ import annotations

from typing import Any

from contracts import pipeline_table
from contracts.messages import Manifest, ShardSealed
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training import autoencoder_job, job_records, lineage, tokenizer_job
from core.start_training.pretrained import PretrainedBase


def claim(manifest: Manifest, name: str, lock: dict[str, Any], queue: bool, base: PretrainedBase | None,
          settings: TrainingSettings) -> bool:
    """One transaction: the new shards claimed, the job recorded, the lineage lock taken or queued,
    and (at the lineage's first claim) whether the lineage trains its own VAE."""
    sequence, steps_done = int(lock["sequence"]), int(lock["steps_done"])
    autoencoder = autoencoder_job.needs_autoencoder(lock, base, settings)
    tokenizer = tokenizer_job.needs_tokenizer(lock, base, settings)
    shard_updates = [(pipeline_table.shard_pk(s.shard_id), "SET #s = :claimed, manifest_job = :job REMOVE gsi1pk, gsi1sk",
                      "#s = :pending", {":claimed": "claimed", ":job": name, ":pending": "pending"})
                     for s in manifest.new_shards]
    lineage_update = lineage.claim_update(settings.lineage, name, sequence, queue, autoencoder, base, tokenizer,
                                          settings.recipe_digest)
    job = job_records.claimed_job(manifest, name, queue, steps_done, autoencoder, base, settings, tokenizer)
    return aws.transact_updates(settings.table, [*shard_updates, lineage_update], [job],
                                names={"#s": "status", **lineage.CLAIM_NAMES})


def mark_trained(job: dict[str, Any], settings: TrainingSettings) -> None:
    """The manifest's new shards join the trained index; the lineage has trained to the job's target."""
    manifest = Manifest.model_validate_json(aws.read_object(settings.data_bucket, job["manifest"]))
    for shard in manifest.new_shards:
        aws.update_item(settings.table, pipeline_table.shard_pk(shard.shard_id),
                        "SET #s = :trained, gsi1pk = :p, gsi1sk = :k, #ref = :ref",
                        {":trained": "trained", ":p": pipeline_table.TRAINED_SHARDS, ":k": shard.shard_id,
                         ":ref": shard.model_dump_json()}, names={"#s": "status", "#ref": "ref"})
    target = job_records.steps_target(job, len(settings.run_plan) - 1, settings)
    aws.update_item(settings.table, pipeline_table.lineage_pk(settings.lineage), "SET steps_done = :t", {":t": target})


def return_to_pending(job: dict[str, Any], settings: TrainingSettings) -> None:
    """A failed or stopped job loses no shard: each goes back to the pending index."""
    name = job.get("base") or pipeline_table.job_name(job["pk"])  # shards name the manifest's first job
    for shard_id in job.get("shards", []):
        item = aws.get_item(settings.table, pipeline_table.shard_pk(shard_id)) or {}
        shard = ShardSealed.model_validate_json(item["record"])
        aws.update_item(settings.table, pipeline_table.shard_pk(shard_id),
                        "SET #s = :pending, gsi1pk = :p, gsi1sk = :k REMOVE manifest_job",
                        {":pending": "pending", ":p": pipeline_table.PENDING_SHARDS, ":k": f"{shard.sealed_at}#{shard_id}",
                         ":job": name}, condition="manifest_job = :job", names={"#s": "status"})
