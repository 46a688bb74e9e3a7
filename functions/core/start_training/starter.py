"""Start-training stage: count sealed shards; at the quota, run one job (per run-plan job) on
exactly those shards. The commit protocol is in docs/training-jobs.md; in brief:

- Shards wait in the sparse `SHARDS#pending` index. Claiming a manifest is one DynamoDB
  transaction: every shard still pending -> claimed, the job record created, and the lineage lock
  taken (or, under the `queue` policy while a job runs, the manifest appended to the lineage's
  queue). Two invocations can never claim one shard, start two jobs, or drop a shard.
- Names derive from the manifest (which includes the lineage's sequence number), so a redelivered
  event re-issues the same CreateTrainingJob, answered ResourceInUse: a no-op once checked to be
  the same manifest, an error if it is another.
- A job's end (the SageMaker state-change event) releases the lock: Completed marks its new shards
  trained and starts the next run-plan job or the next manifest; Failed and Stopped return its shards to
  pending, so the next job takes them. A Completed job's lineage and attribution are written
  beside its model (core.partners.attribution).
- Latent shards (when an encode instance type is set): before each training job, an encode
  job `<job>-enc` (the training image, task=encode) writes the manifest's shards as latent shards
  under `s3://<models>/encoded/<job>/`; on its Completed event every shard's latent twin is checked
  and listed in `manifests/<job>.latents.manifest`, the training job's `train` channel. An encode job
  that fails, or leaves a shard out, fails its training job (the shards return to pending). It gets
  the training job's `manifest` channel too: an excluded sample is never encoded (core.start_training.encode_job).
- Pretrained parts (PretrainedModelUri, core.start_training.pretrained): every encode, training and autoencoder job
  reads the base as the channel `pretrained` (hyperparameter `pretrained=pretrained`); a job records
  the base it was claimed with (URI and digest), which its lineage.json carries.
- The lineage's VAE (core.start_training.autoencoder_job), decided once per lineage at its first claim: when the
  base brings none (no base, or a prefix without vae/config.json), the job waits first for an
  autoencoder job `<job>-ae` (task=autoencoder) on its image shards; its Completed event stores its
  model.tar.gz as the lineage's `vae_uri` (create-only), and every encode and training job of the
  lineage reads that as the channel `vae` (`vae=vae`). A failed or stopped autoencoder job fails its
  training job as a failed encode job does; the lineage's next job trains a VAE again.
- The lineage's tokenizers (core.start_training.tokenizer_job), the same way: when the base brings no
  tokenizer/, a tokenizer job `<job>-tok` (task=tokenizer) learns them from the job's captions; its
  model.tar.gz becomes the lineage's `tokenizer_uri`, every encode and training job's channel
  `tokenizer`. core.start_training.lineage_parts sequences both parts (the VAE first).
- Compiled shapes (core.start_training.compile_caches): a training job's end publishes the files its
  compile left in the lineage's checkpoints to one shared prefix, and every training job reads that
  prefix as its `compile-cache` channel, so a shape compiles once for all lineages.
- Licensing: a manifest leaves out the samples the partner registry's terms or a takedown forbid
  (core.partners.licensing, core.provenance), listing them per shard in `exclude` for the trainer to skip
  and saying why in `left_out`; a shard with nothing left is left out whole (status `excluded`).

This module is the orchestration; what it builds lives beside it: the manifest, its licensing screen
and its files (core.start_training.manifests), the shards' claim and settling (core.start_training.shard_claims), the
lineage's and the job's records (core.start_training.lineage, job_records) and the CreateTrainingJob requests
(core.start_training.job_requests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from contracts.messages import ShardRef, ShardSealed
from core import aws, telemetry
from core.partners import attribution
from core.start_training.settings import TrainingSettings
from core.start_training import (compile_caches, encode_job, failure_brake, job_records, lineage, lineage_parts,
                                 manifests, shard_claims)
from core.start_training.job_records import Inputs
from core.start_training.job_requests import encode_job_name, training_job_request
from core.start_training.pretrained import describe_base, lora_refusal

logger = Logger(child=True)
ENDED = frozenset({"Completed", "Failed", "Stopped"})
RESUME_SOURCE, RESUME_REQUEST = "atelier.cli", "Lineage Resumed"  # `atelier lineage resume NAME`


class JobNameCollision(RuntimeError):
    """A job of our name exists for another manifest: never silently skipped."""


@dataclass(frozen=True)
class StartDecision:
    # waiting | started | queued | already-claimed | busy | not-ours; a helper job's end:
    # encoded | encode-failed | autoencoded | autoencoder-failed | tokenized | tokenizer-failed
    action: str
    job_name: str | None = None
    pending: int = 0


# --- orchestration: events in -------------------------------------------------------------------

def on_shard_sealed(shard: ShardSealed, settings: TrainingSettings) -> StartDecision:
    if not aws.put_item_if_absent(settings.table, pipeline_table.shard_item(shard)):
        item = aws.get_item(settings.table, pipeline_table.shard_pk(shard.shard_id)) or {}
        if item.get("status") != "pending":
            # A redelivery after the claim: make sure the claimed job really runs.
            advance(settings)
            return StartDecision("already-claimed", item.get("manifest_job"))
    return advance(settings)


def on_job_finished(name: str, status: str, reason: str | None, settings: TrainingSettings) -> StartDecision:
    """A job reached Completed, Failed or Stopped: settle its shards, free the lineage, go on."""
    job = aws.get_item(settings.table, pipeline_table.job_pk(name))
    if job is None or job.get("lineage", settings.lineage) != settings.lineage:
        return StartDecision("not-ours", name)
    if job.get("role") == encode_job.ROLE:
        return on_encode_finished(job, status, reason, settings)
    if part := lineage_parts.part_of(job.get("role")):
        return on_part_finished(part, job, status, reason, settings)
    if job_records.record_end(job, status, reason, settings.table):
        _settle(job, status, settings)
        _apply_brake(name, status, reason, settings)  # once per job: before `advance` reads it
    if status == "Completed":  # every delivery (idempotent), so a crash after settling is made good
        attribution.record_model(name, settings)
    # Whatever its end, what the job compiled is kept for every lineage (idempotent too); before
    # `advance`, so the job it starts already reads it
    compile_caches.publish(settings.models_bucket, settings.lineage)
    return advance(settings)


def on_encode_finished(job: dict[str, Any], status: str, reason: str | None, settings: TrainingSettings) -> StartDecision:
    """An encode job ended: Completed with every latent shard lets its training job start on them;
    anything else fails the training job (its shards return to pending, the lineage goes on)."""
    name, training_job = pipeline_table.job_name(job["pk"]), job["for_job"]
    job_records.record_end(job, status, reason, settings.table)
    if status != "Completed":
        on_job_finished(training_job, "Failed", f"encode job {name} {status}: {reason or 'no reason given'}", settings)
        return StartDecision("encode-failed", training_job)
    try:
        latents_uri, indexes_uri = encode_job.write_latent_manifest(training_job, settings)
    except encode_job.EncodeIncomplete as exc:
        on_job_finished(training_job, "Failed", f"encode job {name}: {exc}", settings)
        return StartDecision("encode-failed", training_job)
    aws.update_item(settings.table, pipeline_table.job_pk(training_job), "SET latents = :u, latent_indexes = :i",
                    {":u": latents_uri, ":i": indexes_uri}, condition="attribute_exists(pk)")
    logger.info("latent shards ready", extra={"job": training_job, "encode_job": name, "latents": latents_uri})
    advance(settings)
    return StartDecision("encoded", training_job)


def on_part_finished(part: lineage_parts.Part, job: dict[str, Any], status: str, reason: str | None,
                     settings: TrainingSettings) -> StartDecision:
    """The lineage's autoencoder or tokenizer job ended: Completed, its model.tar.gz becomes the lineage's
    part and the training job goes on (its next part's job, or its encode job, first); anything else fails
    the training job (its shards return to pending, and the lineage's next job makes the part again)."""
    training_job = job["for_job"]
    job_records.record_end(job, status, reason, settings.table)
    failure = lineage_parts.store(part, job, status, reason, settings)
    if failure:
        on_job_finished(training_job, "Failed", failure, settings)
        return StartDecision(part.failed, training_job)
    advance(settings)
    return StartDecision(part.done, training_job)


# --- orchestration: the lineage's one job at a time ---------------------------------------------

def advance(settings: TrainingSettings, attempts: int = 3) -> StartDecision:
    """Make sure the lineage's running job runs; otherwise start (or queue) what is due.

    A claim lost to a concurrent invocation is retried on a fresh read: the winner may have
    left shards that are due too (a queued manifest, say)."""
    decision = StartDecision("already-claimed")
    for _ in range(attempts):
        decision = _advance_once(settings)
        if decision.action != "already-claimed":
            return decision
    return decision


def _advance_once(settings: TrainingSettings) -> StartDecision:
    lock = _lineage(settings)
    running = lock.get("running_job")
    if running:
        _ensure_started(running, settings)
        if settings.concurrency == "skip":
            return StartDecision("busy", running)
        return _claim_next(settings, lock, queue=True)
    held = failure_brake.hold(failure_brake.Brake.from_item(lock), _now())
    if held:  # the pending shards wait; the schedule (or the next event) looks again
        logger.info("lineage held", extra={"lineage": settings.lineage, "why": held})
        return StartDecision("halted" if lock.get("halted") else "backing-off")
    if lock.get("queue"):
        return _start_queued(lock["queue"][0], settings)
    return _claim_next(settings, lock, queue=False)


def _apply_brake(name: str, status: str, reason: str | None, settings: TrainingSettings) -> None:
    """A Failed job backs the lineage off (and may halt it); a Completed one releases the brake."""
    if status not in ("Failed", "Completed"):
        return  # Stopped: a person stopped it, which says nothing about the next job
    brake = failure_brake.Brake.from_item(_lineage(settings))
    after = failure_brake.after_failure(brake, name, reason, _now(), settings.brake) if status == "Failed" \
        else failure_brake.after_success(brake)
    write_brake(after, settings.table, settings.lineage)
    if after.halted and not brake.halted:
        logger.error("lineage halted", extra={"lineage": settings.lineage, "failures": list(after.failures[-3:])})
        telemetry.count(telemetry.LINEAGES_HALTED)
    elif status == "Failed":
        logger.warning("lineage backing off", extra={"lineage": settings.lineage, "until": after.not_before,
                                                     "model_failures": after.model_failures})


def resume(settings: TrainingSettings) -> StartDecision:
    """An operator resumed the lineage (`atelier lineage resume`): lift its failure brake, keeping the
    failures on record, and start what is due."""
    brake = failure_brake.Brake.from_item(_lineage(settings))
    write_brake(failure_brake.resumed(brake), settings.table, settings.lineage)
    return advance(settings)


def write_brake(brake: failure_brake.Brake, table: str, lineage_name: str) -> None:
    expression, values, names = lineage.brake_update(brake)
    aws.update_item(table, pipeline_table.lineage_pk(lineage_name), expression, values, names=names)


def _now() -> float:
    return datetime.now(timezone.utc).timestamp()


def _lineage(settings: TrainingSettings) -> dict[str, Any]:
    aws.put_item_if_absent(settings.table, lineage.new_item(settings.lineage))
    return aws.get_item(settings.table, pipeline_table.lineage_pk(settings.lineage)) or {}


def _claim_next(settings: TrainingSettings, lock: dict[str, Any], queue: bool) -> StartDecision:
    pending = [ShardSealed.model_validate_json(i["record"])
               for i in aws.query_index(settings.table, pipeline_table.PENDING_INDEX, pipeline_table.PENDING_SHARDS)]
    trained = [ShardRef.model_validate_json(i["ref"])
               for i in aws.query_index(settings.table, pipeline_table.PENDING_INDEX, pipeline_table.TRAINED_SHARDS)]
    sequence = int(lock["sequence"]) + 1
    screen = manifests.Screen(pending, trained, settings) if len(pending) >= settings.quota else None
    manifest = manifests.manifest_from(pending, trained, settings, sequence, screen)
    if manifest is None:
        return StartDecision("waiting", pending=len(pending))
    base = describe_base(settings.pretrained_uri) if settings.pretrained_uri else None  # as it is when claimed
    name = manifests.job_name_for(manifest)
    if refused := lineage.base_change(lock, base) or lora_refusal(base, settings.lora_jobs):
        return _halt_for(refused, name, settings)
    manifests.write_files(manifest, name, settings.data_bucket)
    if not shard_claims.claim(manifest, name, lock, queue, base, settings):
        return StartDecision("already-claimed", pending=len(pending))
    if screen:  # the shards this manifest left out whole, with why, leave the pending index
        manifests.leave_out_whole(screen.verdicts, {s.shard_id for s in pending}, settings)
    if queue:
        logger.info("manifest queued behind the running job", extra={"job": name})
        return StartDecision("queued", name, pending=len(pending))
    if not _ensure_started(name, settings):
        return StartDecision("backing-off", name, pending=len(pending))
    return StartDecision("started", name, pending=len(pending))


def _halt_for(reason: str, name: str, settings: TrainingSettings) -> StartDecision:
    """Nothing is claimed; the lineage halts (LineageHaltedAlarm, `atelier status`) until a person acts."""
    brake = failure_brake.Brake.from_item(_lineage(settings))
    if not brake.halted:
        write_brake(failure_brake.halted_by(brake, name, reason, _now()), settings.table, settings.lineage)
        telemetry.count(telemetry.LINEAGES_HALTED)
    logger.error("lineage halted", extra={"lineage": settings.lineage, "why": reason})
    return StartDecision("halted", name)


def _start_queued(name: str, settings: TrainingSettings) -> StartDecision:
    """The queue's head becomes the running job (conditional: only one invocation does it)."""
    taken = aws.update_item(
        settings.table, pipeline_table.lineage_pk(settings.lineage), "SET running_job = :job REMOVE #q[0]",
        {":job": name, ":empty": ""}, condition="running_job = :empty AND #q[0] = :job", names={"#q": "queue"})
    if taken:
        aws.update_item(settings.table, pipeline_table.job_pk(name), "SET #s = :s, steps_base = :b", {
            ":s": "Requested", ":b": int(_lineage(settings)["steps_done"])}, names={"#s": "status"})
        if not _ensure_started(name, settings):
            return StartDecision("backing-off", name)
    return StartDecision("started" if taken else "already-claimed", name)


def _settle(job: dict[str, Any], status: str, settings: TrainingSettings) -> None:
    name = pipeline_table.job_name(job["pk"])
    plan_index = int(job.get("stage", 0))
    if status == "Completed" and plan_index + 1 < len(settings.run_plan):
        _start_next_planned_job(job, plan_index + 1, settings)
        return
    if status == "Completed":
        shard_claims.mark_trained(job, settings)
    else:
        shard_claims.return_to_pending(job, settings)
    aws.update_item(settings.table, pipeline_table.lineage_pk(settings.lineage), "SET running_job = :empty",
                    {":empty": "", ":job": name}, condition="running_job = :job")


def _start_next_planned_job(job: dict[str, Any], plan_index: int, settings: TrainingSettings) -> None:
    """The next run-plan job resumes the lineage's checkpoints on the same manifest, with its own instances."""
    name = job_records.next_planned_job_name(job, plan_index)
    aws.put_item_if_absent(settings.table, job_records.next_planned_job(job, plan_index, settings))
    aws.update_item(settings.table, pipeline_table.lineage_pk(settings.lineage), "SET running_job = :next",
                    {":next": name, ":job": pipeline_table.job_name(job["pk"])}, condition="running_job = :job")
    _ensure_started(name, settings)


def _ensure_started(name: str, settings: TrainingSettings) -> bool:
    """CreateTrainingJob for a recorded job, after the jobs it waits for (the lineage's autoencoder
    job, its encode job); an existing job of that name must be ours. A quota refusal fails the job
    as a capacity failure (False): its shards return to pending and the lineage backs off."""
    try:
        _start_what_is_due(name, settings)
        return True
    except aws.ServiceQuotaExceeded as exc:
        logger.warning("no quota for the job's instances", extra={"job": name, "error": str(exc)})
        on_job_finished(name, "Failed", str(exc), settings)
        return False


def _start_what_is_due(name: str, settings: TrainingSettings) -> None:
    job = aws.get_item(settings.table, pipeline_table.job_pk(name))
    if job is None or job.get("status") not in ("Requested", "InProgress"):
        return
    plan_index = int(job.get("stage", 0))
    inputs, part = lineage_parts.missing(name, job, job_records.inputs_of(name, job, settings), settings)
    if part is not None:  # the lineage's VAE or tokenizers first
        if not part.begin(name, job, inputs, settings):
            _settle_if_ended(part.job_name(name), name, inputs.manifest_uri,
                             lambda record, *end: on_part_finished(part, record, *end), settings)
        return
    if job.get("encode") and not job.get("latents"):
        _ensure_encoding(name, job, inputs, settings)
        return
    train_uri = job.get("latents") or inputs.manifest_uri
    indexes_uri = job.get("latent_indexes", "") if job.get("latents") else inputs.indexes_uri
    steps_target = job_records.steps_target(job, plan_index, settings)
    request = training_job_request(name, train_uri, job["digest"], plan_index, steps_target, settings,
                                   inputs.exclusions_uri, pretrained_uri=inputs.pretrained_uri, vae_uri=inputs.vae_uri,
                                   first_step=job_records.first_step(job, plan_index, settings), indexes_uri=indexes_uri,
                                   compile_cache=compile_caches.channels(settings.models_bucket),
                                   tokenizer_uri=inputs.tokenizer_uri)
    if aws.create_training_job(request):
        logger.info("training job started", extra={"job": name, "planned_job": settings.run_plan[plan_index].name,
                                                   "latents": bool(job.get("latents")), "vae": inputs.vae_uri})
        return
    _check_ours(name, name, train_uri, settings)


def _ensure_encoding(name: str, job: dict[str, Any], inputs: Inputs, settings: TrainingSettings) -> None:
    if not encode_job.start(name, job, inputs.manifest_uri, inputs.exclusions_uri, inputs.pretrained_uri,
                            inputs.vae_uri, settings, inputs.indexes_uri, inputs.tokenizer_uri):
        _settle_if_ended(encode_job_name(name), name, inputs.manifest_uri, on_encode_finished, settings)


def _settle_if_ended(preceding: str, name: str, manifest_uri: str,
                     on_finished: Callable[[dict[str, Any], str, str | None, TrainingSettings], StartDecision],
                     settings: TrainingSettings) -> None:
    """`preceding` (the encode or autoencoder job `name` waits for) already exists: it must be ours, and
    if it has ended unsettled its end is handled now, in case its event was lost."""
    existing = _check_ours(preceding, name, manifest_uri, settings)
    record = aws.get_item(settings.table, pipeline_table.job_pk(preceding)) or {}
    if existing["TrainingJobStatus"] in ENDED and "settled" not in record:
        on_finished(record, existing["TrainingJobStatus"], existing.get("FailureReason"), settings)


def _check_ours(name: str, training_job: str, expected_uri: str, settings: TrainingSettings) -> dict[str, Any]:
    """An existing job of our name must read our channel; its description if it does."""
    existing = aws.sagemaker_call("describe_training_job", {"TrainingJobName": name})
    their_uri = existing["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"]
    if their_uri != expected_uri:
        # Settle the job as failed (its shards return to pending, the lineage is freed, the next
        # sequence names a new job), then fail loudly: the event goes to the DLQ for a person.
        reason = f"job name {name} is taken by a job reading {their_uri}, not {expected_uri}"
        on_job_finished(training_job, "Failed", reason, settings)
        raise JobNameCollision(reason)
    return existing
