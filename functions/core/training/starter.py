"""Start-training stage: count sealed shards; at the quota, run one job (per run-plan stage) on
exactly those shards. The commit protocol is in docs/training-jobs.md; in brief:

- Shards wait in the sparse `SHARDS#pending` index. Claiming a manifest is one DynamoDB
  transaction: every shard still pending -> claimed, the job record created, and the lineage lock
  taken (or, under the `queue` policy while a job runs, the manifest appended to the lineage's
  queue). Two invocations can never claim one shard, start two jobs, or drop a shard.
- Names derive from the manifest (which includes the lineage's sequence number), so a redelivered
  event re-issues the same CreateTrainingJob, answered ResourceInUse: a no-op once checked to be
  the same manifest, an error if it is another.
- A job's end (the SageMaker state-change event) releases the lock: Completed marks its new shards
  trained and starts the next stage or the next manifest; Failed and Stopped return its shards to
  pending, so the next job takes them. A Completed job's lineage and attribution are written
  beside its model (core.partners.attribution).
- Latent shards (when an encode instance type is set): before a stage's training job, an encode
  job `<job>-enc` (the training image, task=encode) writes the manifest's shards as latent shards
  under `s3://<models>/encoded/<job>/`; on its Completed event every shard's latent twin is checked
  and listed in `manifests/<job>.latents.manifest`, the training job's `train` channel. An encode job
  that fails, or leaves a shard out, fails its training job (the shards return to pending). It gets
  the training job's `manifest` channel too: an excluded sample is never encoded (core.training.encode_job).
- Pretrained parts (PretrainedModelUri, core.training.pretrained): every encode, training and autoencoder job
  reads the base as the channel `pretrained` (hyperparameter `pretrained=pretrained`); a job records
  the base it was claimed with (URI and digest), which its lineage.json carries.
- The lineage's VAE (core.training.autoencoder_job), decided once per lineage at its first claim: when the
  base brings none (no base, or a prefix without vae/config.json), the job waits first for an
  autoencoder job `<job>-ae` (task=autoencoder) on its image shards; its Completed event stores its
  model.tar.gz as the lineage's `vae_uri` (create-only), and every encode and training job of the
  lineage reads that as the channel `vae` (`vae=vae`). A failed or stopped autoencoder job fails its
  training job as a failed encode job does; the lineage's next job trains a VAE again.
- Licensing: a manifest leaves out the samples the partner registry's terms or a takedown forbid
  (core.partners.licensing, core.provenance), listing them per shard in `exclude` for the trainer to skip
  and saying why in `left_out`; a shard with nothing left is left out whole (status `excluded`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from contracts.messages import Manifest, ShardRef, ShardSealed
from core import aws, telemetry
from core.partners import attribution, licensing
from core.provenance import Verdict, screen_shard
from core.settings import TrainingSettings
from core.training import autoencoder_job, encode_job, failure_brake
from core.training.job_requests import MANIFEST_PREFIX, autoencoder_job_name, encode_job_name, training_job_request
from core.training.pretrained import PretrainedBase, describe_base

logger = Logger(child=True)
NO_BASE = "none"  # a lineage's base_digest when it trains without PretrainedModelUri
TRAINED_SHARDS = "SHARDS#trained"
ENDED = frozenset({"Completed", "Failed", "Stopped"})
RESUME_SOURCE, RESUME_REQUEST = "atelier.cli", "Lineage Resumed"  # `atelier lineage resume NAME`


class JobNameCollision(RuntimeError):
    """A job of our name exists for another manifest: never silently skipped."""


@dataclass(frozen=True)
class Decision:
    # waiting | started | queued | already-claimed | busy | not-ours; a helper job's end:
    # encoded | encode-failed | autoencoded | autoencoder-failed
    action: str
    job_name: str | None = None
    pending: int = 0


# --- pure ---------------------------------------------------------------------------------------

def job_name_for(manifest: Manifest, stage_index: int = 0) -> str:
    """At most 63 characters of [a-zA-Z0-9-], unique per manifest and stage."""
    return f"atelier-{manifest.digest[:20]}" + (f"-s{stage_index}" if stage_index else "")


def manifest_from(pending: list[ShardSealed], trained: list[ShardRef], settings: TrainingSettings,
                  sequence: int, screen: Callable[[ShardRef], Verdict] | None = None) -> Manifest | None:
    """The oldest `quota` pending shards that `screen` leaves something of, plus a replay share of
    trained ones; None below quota. Samples and shards screened out are listed with their reasons."""
    if len(pending) < settings.quota:
        return None
    new: list[ShardRef] = []
    verdicts: dict[str, Verdict] = {}
    for s in sorted(pending, key=lambda s: (s.sealed_at, s.shard_id)):
        if len(new) == settings.quota:
            break
        ref = ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples, partners=tuple(s.partners))
        verdicts[s.shard_id] = screen(ref) if screen else Verdict()
        if not verdicts[s.shard_id].whole:
            new.append(ref)
    if len(new) < settings.quota:
        return None
    replay = []
    for ref in replay_shards(new, trained, settings.replay_share):
        verdicts[ref.shard_id] = screen(ref) if screen else Verdict()
        if not verdicts[ref.shard_id].whole:
            replay.append(ref)
    return Manifest(bucket=settings.data_bucket, prefix="shards/", shards=tuple(new + replay),
                    lineage=settings.lineage, sequence=sequence,
                    exclude={i: v.keys for i, v in verdicts.items() if v.keys and not v.whole},
                    left_out=tuple(sorted((e for v in verdicts.values() for e in v.left_out),
                                          key=lambda e: (e.shard_id, e.sha256))))


def replay_shards(new: list[ShardRef], trained: list[ShardRef], share: float) -> list[ShardRef]:
    """Earlier shards making up `share` of the mix, drawn with a seed from the new shards."""
    if share <= 0 or not trained:
        return []
    wanted = min(len(trained), int(len(new) * share / (1 - share) + 0.5))  # half up, not to even
    seed = int(hashlib.sha256("".join(s.shard_id for s in new).encode()).hexdigest()[:16], 16)
    picked = random.Random(seed).sample(sorted(trained, key=lambda s: s.shard_id), wanted)
    return [s.model_copy(update={"role": "replay"}) for s in sorted(picked, key=lambda s: s.shard_id)]


def manifest_file(manifest: Manifest) -> list[Any]:
    """A SageMaker ManifestFile: a prefix, then keys relative to it."""
    relative = [s.key.removeprefix(manifest.prefix) for s in manifest.shards]
    return [{"prefix": f"s3://{manifest.bucket}/{manifest.prefix}"}, *relative]


def wids_shard_list(manifest: Manifest, name: str) -> dict[str, Any]:
    """The manifest as the shard-list JSON `wids.ShardListDataset` opens (webdataset's wids spec).

    URLs are relative to the list's own key (`manifests/`), so the list opens in place on S3 or in a
    synced copy of the bucket. `nsamples` counts every sample in the tar, as wids indexes it; samples
    the trainer skips (revoked or no longer licensed) are listed per shard under `atelier_exclude`,
    which wids ignores: a reader must drop those `__key__`s itself (docs/pack.md).
    """
    depth = MANIFEST_PREFIX.count("/")
    shards = []
    for shard in manifest.shards:
        entry: dict[str, Any] = {"url": "../" * depth + shard.key, "nsamples": shard.samples}
        if manifest.exclude.get(shard.shard_id):
            entry["atelier_exclude"] = list(manifest.exclude[shard.shard_id])
        shards.append(entry)
    return {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": name, "shardlist": shards}


# --- orchestration: events in -------------------------------------------------------------------

def on_shard_sealed(shard: ShardSealed, settings: TrainingSettings) -> Decision:
    if not aws.put_item_if_absent(settings.table, pipeline_table.shard_item(shard)):
        item = aws.get_item(settings.table, pipeline_table.shard_pk(shard.shard_id)) or {}
        if item.get("status") != "pending":
            # A redelivery after the claim: make sure the claimed job really runs.
            advance(settings)
            return Decision("already-claimed", item.get("manifest_job"))
    return advance(settings)


def on_job_finished(name: str, status: str, reason: str | None, settings: TrainingSettings) -> Decision:
    """A job reached Completed, Failed or Stopped: settle its shards, free the lineage, go on."""
    job = aws.get_item(settings.table, pipeline_table.job_pk(name))
    if job is None or job.get("lineage", settings.lineage) != settings.lineage:
        return Decision("not-ours", name)
    if job.get("role") == encode_job.ROLE:
        return on_encode_finished(job, status, reason, settings)
    if job.get("role") == autoencoder_job.ROLE:
        return on_autoencoder_finished(job, status, reason, settings)
    if _record_end(job, status, reason, settings):
        _settle(job, status, settings)
        _apply_brake(name, status, reason, settings)  # once per job: before `advance` reads it
    if status == "Completed":  # every delivery (idempotent), so a crash after settling is made good
        attribution.record_model(name, settings)
    return advance(settings)


def on_encode_finished(job: dict[str, Any], status: str, reason: str | None, settings: TrainingSettings) -> Decision:
    """An encode job ended: Completed with every latent shard lets its training job start on them;
    anything else fails the training job (its shards return to pending, the lineage goes on)."""
    name, training_job = job["pk"].removeprefix("JOB#"), job["for_job"]
    _record_end(job, status, reason, settings)
    if status != "Completed":
        on_job_finished(training_job, "Failed", f"encode job {name} {status}: {reason or 'no reason given'}", settings)
        return Decision("encode-failed", training_job)
    try:
        latents_uri = encode_job.write_latent_manifest(training_job, settings)
    except encode_job.EncodeIncomplete as exc:
        on_job_finished(training_job, "Failed", f"encode job {name}: {exc}", settings)
        return Decision("encode-failed", training_job)
    aws.update_item(settings.table, pipeline_table.job_pk(training_job), "SET latents = :u", {":u": latents_uri},
                    condition="attribute_exists(pk)")
    logger.info("latent shards ready", extra={"job": training_job, "encode_job": name, "latents": latents_uri})
    advance(settings)
    return Decision("encoded", training_job)


def on_autoencoder_finished(job: dict[str, Any], status: str, reason: str | None,
                            settings: TrainingSettings) -> Decision:
    """The lineage's autoencoder job ended: Completed, its model.tar.gz becomes the lineage's VAE and
    the training job goes on (its encode job first, when encoding); anything else fails the training
    job (its shards return to pending, and the lineage's next job trains a VAE again)."""
    name, training_job = job["pk"].removeprefix("JOB#"), job["for_job"]
    _record_end(job, status, reason, settings)
    vae_uri = autoencoder_job.artefact(name) if status == "Completed" else ""
    if not vae_uri:
        why = "no ModelArtifacts" if status == "Completed" else reason or "no reason given"
        on_job_finished(training_job, "Failed", f"autoencoder job {name} {status}: {why}", settings)
        return Decision("autoencoder-failed", training_job)
    autoencoder_job.store_vae(name, vae_uri, settings)  # create-only: a redelivered event changes nothing
    advance(settings)
    return Decision("autoencoded", training_job)


def _record_end(job: dict[str, Any], status: str, reason: str | None, settings: TrainingSettings) -> bool:
    """A job's end on its record, once: False when an earlier delivery recorded it."""
    return aws.update_item(settings.table, job["pk"], "SET settled = :s, #st = :status, failure_reason = :r",
                           {":s": status, ":status": status, ":r": reason or ""},
                           condition="attribute_not_exists(settled)", names={"#st": "status"})


# --- orchestration: the lineage's one job at a time ---------------------------------------------

def advance(settings: TrainingSettings, attempts: int = 3) -> Decision:
    """Make sure the lineage's running job runs; otherwise start (or queue) what is due.

    A claim lost to a concurrent invocation is retried on a fresh read: the winner may have
    left shards that are due too (a queued manifest, say)."""
    decision = Decision("already-claimed")
    for _ in range(attempts):
        decision = _advance_once(settings)
        if decision.action != "already-claimed":
            return decision
    return decision


def _advance_once(settings: TrainingSettings) -> Decision:
    lock = _lineage(settings)
    running = lock.get("running_job")
    if running:
        _ensure_started(running, settings)
        if settings.concurrency == "skip":
            return Decision("busy", running)
        return _claim_next(settings, lock, queue=True)
    held = failure_brake.hold(failure_brake.Brake.from_item(lock), _now())
    if held:  # the pending shards wait; the schedule (or the next event) looks again
        logger.info("lineage held", extra={"lineage": settings.lineage, "why": held})
        return Decision("halted" if lock.get("halted") else "backing-off")
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


def write_brake(brake: failure_brake.Brake, table: str, lineage: str) -> None:
    item = brake.to_item()
    aws.update_item(table, f"LINEAGE#{lineage}", "SET " + ", ".join(f"#{k} = :{k}" for k in item),
                    {f":{k}": v for k, v in item.items()}, names={f"#{k}": k for k in item})


def _now() -> float:
    return datetime.now(timezone.utc).timestamp()


def _lineage(settings: TrainingSettings) -> dict[str, Any]:
    pk = f"LINEAGE#{settings.lineage}"
    aws.put_item_if_absent(settings.table, {"pk": pk, "kind": "lineage", "sequence": 0, "steps_done": 0,
                                            "queue": [], "running_job": ""})
    return aws.get_item(settings.table, pk) or {}


def _claim_next(settings: TrainingSettings, lock: dict[str, Any], queue: bool) -> Decision:
    pending = [ShardSealed.model_validate_json(i["record"])
               for i in aws.query_index(settings.table, pipeline_table.PENDING_INDEX, pipeline_table.PENDING_SHARDS)]
    trained = [ShardRef.model_validate_json(i["ref"])
               for i in aws.query_index(settings.table, pipeline_table.PENDING_INDEX, TRAINED_SHARDS)]
    sequence = int(lock["sequence"]) + 1
    screen = _Screen(pending, trained, settings) if len(pending) >= settings.quota else None
    manifest = manifest_from(pending, trained, settings, sequence, screen)
    if manifest is None:
        return Decision("waiting", pending=len(pending))
    base = describe_base(settings.pretrained_uri) if settings.pretrained_uri else None  # as it is when claimed
    name = job_name_for(manifest)
    if changed := _base_change(lock, base):
        return _halt_for(changed, name, settings)
    _write_manifest(manifest, name, settings)
    if not _claim(manifest, name, lock, queue, base, settings):
        return Decision("already-claimed", pending=len(pending))
    if screen:  # the shards this manifest left out whole, with why, leave the pending index
        _exclude_shards(screen.verdicts, {s.shard_id for s in pending}, settings)
    if queue:
        logger.info("manifest queued behind the running job", extra={"job": name})
        return Decision("queued", name, pending=len(pending))
    if not _ensure_started(name, settings):
        return Decision("backing-off", name, pending=len(pending))
    return Decision("started", name, pending=len(pending))


class _Screen:
    """The registry's terms and the takedowns as of now, applied to a shard at most once."""

    def __init__(self, pending: list[ShardSealed], trained: list[ShardRef], settings: TrainingSettings) -> None:
        partners = {p for s in pending for p in s.partners} | {p for s in trained for p in s.partners}
        self.rules = licensing.rules_for(settings.table, partners, settings.use)
        self.settings = settings
        self.verdicts: dict[str, Verdict] = {}

    def __call__(self, shard: ShardRef) -> Verdict:
        if shard.shard_id not in self.verdicts:
            self.verdicts[shard.shard_id] = screen_shard(shard, self.rules, self.settings.data_bucket, self.settings.table)
        return self.verdicts[shard.shard_id]


def _exclude_shards(verdicts: dict[str, Verdict], pending: set[str], settings: TrainingSettings) -> None:
    """Pending shards with nothing left to train on leave the pending index for good, with the reason
    (after the claim: a crash before this leaves them pending, and the next manifest lists them again)."""
    for shard_id, verdict in verdicts.items():
        if verdict.whole and shard_id in pending:
            aws.update_item(settings.table, pipeline_table.shard_pk(shard_id),
                            "SET #s = :excluded, excluded_reason = :r REMOVE gsi1pk, gsi1sk",
                            {":excluded": "excluded", ":r": verdict.left_out[0].reason, ":pending": "pending"},
                            condition="#s = :pending", names={"#s": "status"})


def _write_manifest(manifest: Manifest, name: str, settings: TrainingSettings) -> None:
    """Deterministic content under the job's name: writing it twice is harmless."""
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.json",
                     manifest.model_dump_json(indent=1).encode(), "application/json")
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.manifest",
                     json.dumps(manifest_file(manifest)).encode(), "application/json")
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.wids.json",
                     json.dumps(wids_shard_list(manifest, name), indent=1).encode(), "application/json")


def _base_digest(base: PretrainedBase | None) -> str:
    return base.digest if base else NO_BASE


def _base_change(lock: dict[str, Any], base: PretrainedBase | None) -> str | None:
    """Why the lineage may not go on with this base: its checkpoints were trained from another."""
    recorded = lock.get("base_digest")
    if recorded is None or recorded == _base_digest(base):
        return None
    was = "no base" if recorded == NO_BASE else f"the base with digest {recorded[:16]}"
    now = f"{base.uri} (digest {base.digest[:16]})" if base else "no base"
    return (f"BaseChanged: lineage {lock['pk'].removeprefix('LINEAGE#')} was trained from {was}, and PretrainedModelUri "
            f"now gives {now}: its checkpoints do not fit another base. Set TrainingLineage to a new name to train on "
            "the new base, or set PretrainedModelUri back; then `atelier lineage resume`")


def _halt_for(reason: str, name: str, settings: TrainingSettings) -> Decision:
    """Nothing is claimed; the lineage halts (LineageHaltedAlarm, `atelier status`) until a person acts."""
    brake = failure_brake.Brake.from_item(_lineage(settings))
    if not brake.halted:
        write_brake(failure_brake.halted_by(brake, name, reason, _now()), settings.table, settings.lineage)
        telemetry.count(telemetry.LINEAGES_HALTED)
    logger.error("lineage halted", extra={"lineage": settings.lineage, "why": reason})
    return Decision("halted", name)


def _claim(manifest: Manifest, name: str, lock: dict[str, Any], queue: bool, base: PretrainedBase | None,
           settings: TrainingSettings) -> bool:
    """One transaction: the new shards claimed, the job recorded, the lineage lock taken or queued,
    and (at the lineage's first claim) whether the lineage trains its own VAE."""
    sequence, steps_done = int(lock["sequence"]), int(lock["steps_done"])
    autoencoder = autoencoder_job.needs_autoencoder(lock, base, settings)
    shard_updates = [(pipeline_table.shard_pk(s.shard_id), "SET #s = :claimed, manifest_job = :job REMOVE gsi1pk, gsi1sk",
                      "#s = :pending", {":claimed": "claimed", ":job": name, ":pending": "pending"})
                     for s in manifest.new_shards]
    lineage_update = (
        f"LINEAGE#{settings.lineage}",
        ("SET #q = list_append(#q, :one), #seq = :next" if queue else "SET running_job = :job, #seq = :next")
        + ", autoencoder = if_not_exists(autoencoder, :ae), base_digest = if_not_exists(base_digest, :bd)",
        ("running_job <> :empty AND #seq = :seq" if queue else "running_job = :empty AND #seq = :seq"),
        {":one": [name], ":next": sequence + 1, ":seq": sequence, ":empty": "", ":ae": autoencoder, ":bd": _base_digest(base)}
        if queue else {":job": name, ":next": sequence + 1, ":seq": sequence, ":empty": "", ":ae": autoencoder,
                       ":bd": _base_digest(base)},
    )
    job = {**pipeline_table.job_item(name, f"{MANIFEST_PREFIX}{name}.json", [s.shard_id for s in manifest.new_shards],
                              datetime.now(timezone.utc).isoformat(timespec="seconds")),
           "status": "Queued" if queue else "Requested", "lineage": settings.lineage, "digest": manifest.digest,
           "stage": 0, "base": name, "steps_base": steps_done, "replay": [s.shard_id for s in manifest.shards if s.role == "replay"],
           "sequence": manifest.sequence, "excludes": manifest.excluded,
           # decided once: a settings change never strands a claimed job
           "encode": bool(settings.encode_instance_type), "autoencoder": autoencoder,
           "pretrained": base.model_dump_json() if base else ""}
    return aws.transact_updates(settings.table, [*shard_updates, lineage_update], [job],
                                names={"#s": "status", "#q": "queue", "#seq": "sequence"})


def _start_queued(name: str, settings: TrainingSettings) -> Decision:
    """The queue's head becomes the running job (conditional: only one invocation does it)."""
    taken = aws.update_item(
        settings.table, f"LINEAGE#{settings.lineage}", "SET running_job = :job REMOVE #q[0]",
        {":job": name, ":empty": ""}, condition="running_job = :empty AND #q[0] = :job", names={"#q": "queue"})
    if taken:
        aws.update_item(settings.table, pipeline_table.job_pk(name), "SET #s = :s, steps_base = :b", {
            ":s": "Requested", ":b": int(_lineage(settings)["steps_done"])}, names={"#s": "status"})
        if not _ensure_started(name, settings):
            return Decision("backing-off", name)
    return Decision("started" if taken else "already-claimed", name)


def _settle(job: dict[str, Any], status: str, settings: TrainingSettings) -> None:
    name = job["pk"].removeprefix("JOB#")
    stage = int(job.get("stage", 0))
    if status == "Completed" and stage + 1 < len(settings.stages):
        _start_next_stage(job, stage + 1, settings)
        return
    if status == "Completed":
        _mark_trained(job, settings)
    else:
        _return_to_pending(job, settings)
    aws.update_item(settings.table, f"LINEAGE#{settings.lineage}", "SET running_job = :empty",
                    {":empty": "", ":job": name}, condition="running_job = :job")


def _start_next_stage(job: dict[str, Any], stage: int, settings: TrainingSettings) -> None:
    """The next stage resumes the lineage's checkpoints on the same manifest, with its own instances."""
    name = f"{job['base']}-s{stage}"
    carried = {k: v for k, v in job.items() if k not in {"settled", "failure_reason", "model_data", "latents"}}
    aws.put_item_if_absent(settings.table, {**carried, "pk": pipeline_table.job_pk(name), "status": "Requested",
                                            "stage": stage, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    aws.update_item(settings.table, f"LINEAGE#{settings.lineage}", "SET running_job = :next",
                    {":next": name, ":job": job["pk"].removeprefix("JOB#")}, condition="running_job = :job")
    _ensure_started(name, settings)


def _mark_trained(job: dict[str, Any], settings: TrainingSettings) -> None:
    manifest = Manifest.model_validate_json(aws.read_object(settings.data_bucket, job["manifest"]))
    for shard in manifest.new_shards:
        aws.update_item(settings.table, pipeline_table.shard_pk(shard.shard_id),
                        "SET #s = :trained, gsi1pk = :p, gsi1sk = :k, #ref = :ref",
                        {":trained": "trained", ":p": TRAINED_SHARDS, ":k": shard.shard_id,
                         ":ref": shard.model_dump_json()}, names={"#s": "status", "#ref": "ref"})
    target = _steps_target(job, len(settings.stages) - 1, settings)
    aws.update_item(settings.table, f"LINEAGE#{settings.lineage}", "SET steps_done = :t", {":t": target})


def _return_to_pending(job: dict[str, Any], settings: TrainingSettings) -> None:
    """A failed or stopped job loses no shard: each goes back to the pending index."""
    name = job.get("base") or job["pk"].removeprefix("JOB#")  # shards name the manifest's first job
    for shard_id in job.get("shards", []):
        item = aws.get_item(settings.table, pipeline_table.shard_pk(shard_id)) or {}
        shard = ShardSealed.model_validate_json(item["record"])
        aws.update_item(settings.table, pipeline_table.shard_pk(shard_id),
                        "SET #s = :pending, gsi1pk = :p, gsi1sk = :k REMOVE manifest_job",
                        {":pending": "pending", ":p": pipeline_table.PENDING_SHARDS, ":k": f"{shard.sealed_at}#{shard_id}",
                         ":job": name}, condition="manifest_job = :job", names={"#s": "status"})


def _steps_target(job: dict[str, Any], stage: int, settings: TrainingSettings) -> int:
    return int(job.get("steps_base", 0)) + sum(s.steps for s in settings.stages[:stage + 1])


@dataclass(frozen=True)
class _Inputs:
    """What a claimed job's jobs read: its manifest's shards and exclusions, and its model parts."""

    manifest_uri: str
    exclusions_uri: str
    pretrained_uri: str  # the base it was claimed with ("": none)
    vae_uri: str = ""  # the lineage's VAE, once its autoencoder job has made one


def _inputs(name: str, job: dict[str, Any], settings: TrainingSettings) -> _Inputs:
    base = job.get("base", name)
    return _Inputs(f"s3://{settings.data_bucket}/{MANIFEST_PREFIX}{base}.manifest",
                   f"s3://{settings.data_bucket}/{MANIFEST_PREFIX}{base}.json" if job.get("excludes") else "",
                   PretrainedBase.model_validate_json(job["pretrained"]).uri if job.get("pretrained") else "")


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
    stage = int(job.get("stage", 0))
    inputs = _inputs(name, job, settings)
    if job.get("autoencoder"):
        inputs = replace(inputs, vae_uri=autoencoder_job.vae_for(name, job, settings))
        if not inputs.vae_uri:
            _ensure_autoencoder(name, job, inputs, settings)
            return
    if job.get("encode") and not job.get("latents"):
        _ensure_encoding(name, job, inputs, settings)
        return
    train_uri = job.get("latents") or inputs.manifest_uri
    request = training_job_request(name, train_uri, job["digest"], stage, _steps_target(job, stage, settings), settings,
                                   inputs.exclusions_uri, pretrained_uri=inputs.pretrained_uri, vae_uri=inputs.vae_uri)
    if aws.create_training_job(request):
        logger.info("training job started", extra={"job": name, "stage": settings.stages[stage].name,
                                                   "latents": bool(job.get("latents")), "vae": inputs.vae_uri})
        return
    _check_ours(name, name, train_uri, settings)


def _ensure_encoding(name: str, job: dict[str, Any], inputs: _Inputs, settings: TrainingSettings) -> None:
    """The training job's encode job runs (or has ended: then its end is handled now, in case its
    event was lost)."""
    if encode_job.start(name, job, inputs.manifest_uri, inputs.exclusions_uri, inputs.pretrained_uri, inputs.vae_uri,
                        settings):
        return
    encode_name = encode_job_name(name)
    existing = _check_ours(encode_name, name, inputs.manifest_uri, settings)
    record = aws.get_item(settings.table, pipeline_table.job_pk(encode_name)) or {}
    if existing["TrainingJobStatus"] in ENDED and "settled" not in record:
        on_encode_finished(record, existing["TrainingJobStatus"], existing.get("FailureReason"), settings)


def _ensure_autoencoder(name: str, job: dict[str, Any], inputs: _Inputs, settings: TrainingSettings) -> None:
    """The lineage's autoencoder job runs for this job (or has ended: its end is handled now, in case
    its event was lost)."""
    if autoencoder_job.start(name, job, inputs.manifest_uri, inputs.exclusions_uri, inputs.pretrained_uri, settings):
        return
    ae_name = autoencoder_job_name(name)
    existing = _check_ours(ae_name, name, inputs.manifest_uri, settings)
    record = aws.get_item(settings.table, pipeline_table.job_pk(ae_name)) or {}
    if existing["TrainingJobStatus"] in ENDED and "settled" not in record:
        on_autoencoder_finished(record, existing["TrainingJobStatus"], existing.get("FailureReason"), settings)


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
