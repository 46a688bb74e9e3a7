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
  beside its model (core.attribution).
- Latent shards (when an encode instance type is set): before a stage's training job, an encode
  job `<job>-enc` (the training image, task=encode) writes the manifest's shards as latent shards
  under `s3://<models>/encoded/<job>/`; on its Completed event every shard's latent twin is checked
  and listed in `manifests/<job>.latents.manifest`, the training job's `train` channel. An encode job
  that fails, or leaves a shard out, fails its training job (the shards return to pending). It gets
  the training job's `manifest` channel too: an excluded sample is never encoded.
- Licensing: a manifest leaves out the samples the partner registry's terms or a takedown forbid
  (core.licensing, core.provenance), listing them per shard in `exclude` for the trainer to skip
  and saying why in `left_out`; a shard with nothing left is left out whole (status `excluded`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from aws_lambda_powertools import Logger

from core import attribution, aws, licensing, records
from core.models import Manifest, ShardRef, ShardSealed
from core.provenance import Verdict, screen_shard
from core.settings import Stage, TrainingSettings

logger = Logger(child=True)
MANIFEST_PREFIX = "manifests/"
CHANNEL = "train"
MANIFEST_CHANNEL = "manifest"  # the manifest JSON itself, for its exclusion list (only when it has one)
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
TRAINED_SHARDS = "SHARDS#trained"
FINAL_STAGE_TAG = "atelier:final-stage"
MANIFEST_TAG = "atelier:manifest"
ROLE_TAG = "atelier:role"
ENCODE_SUFFIX = "-enc"
ENCODED_PREFIX = "encoded/"  # in the models bucket: <job>/latents/<encoder identity>-r<res>/<shard path>
# the stage hyperparameters trainer/encode.py shares with trainer/train.py (its latents depend on them)
ENCODE_HYPERPARAMETERS = ("model-config", "pretrained", "seed", "resolution", "aspect-buckets")
# The trainer's JSON log lines (trainer/train.py, docs/trainer.md), parsed by SageMaker into metrics.
METRIC_DEFINITIONS = [  # equal to trainer.health.METRIC_DEFINITIONS (a test holds them together)
    {"Name": f"train:{field}", "Regex": f'"{field}": ([-+0-9.eE]+)'}
    for field in ("loss", "lr", "grad_norm", "img_per_s", "data_wait_share", "skipped_steps", "corrupt_samples")
]


class JobNameCollision(RuntimeError):
    """A job of our name exists for another manifest: never silently skipped."""


class EncodeIncomplete(ValueError):
    """The encode job's output does not hold exactly one latent shard per shard of the manifest."""


@dataclass(frozen=True)
class Decision:
    action: str  # waiting | started | queued | already-claimed | busy
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


def stage_hyperparameters(stage: Stage, steps_target: int) -> dict[str, str]:
    """The stage's hyperparameters, with `steps` as the lineage total this job trains up to
    (checkpoints are shared by the lineage, so a follow-up job resumes at the steps already done)."""
    return {**stage.hyperparameters, "steps": str(steps_target)}


def _job_request(name: str, train_uri: str, hyperparameters: dict[str, str], instances: tuple[str, int],
                 output_prefix: str, checkpoint_uri: str, tags: dict[str, str],
                 settings: TrainingSettings, exclusions_uri: str = "") -> dict[str, Any]:
    """What a training and an encode job's requests share: the `train` channel (a ManifestFile,
    FastFile, ShardedByS3Key), checkpoints, retries, isolation, VPC and KMS. With `exclusions_uri`
    (the manifest JSON) a second channel `manifest` brings the exclusion list to every instance
    (trainer.train and trainer.encode --manifest)."""
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": settings.role_arn,
        "AlgorithmSpecification": {"TrainingImage": settings.image_uri, "TrainingInputMode": "FastFile",
                                   "MetricDefinitions": METRIC_DEFINITIONS},
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
    if exclusions_uri:
        request["InputDataConfig"].append({
            "ChannelName": MANIFEST_CHANNEL,
            "InputMode": "File",
            "ContentType": "application/json",
            "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": exclusions_uri, "S3DataDistributionType": "FullyReplicated",
            }},
        })
    if settings.keep_alive_s:
        request["ResourceConfig"]["KeepAlivePeriodInSeconds"] = settings.keep_alive_s
    if settings.subnets:
        request["VpcConfig"] = {"Subnets": list(settings.subnets), "SecurityGroupIds": list(settings.security_groups)}
    if settings.kms_key:
        request["ResourceConfig"]["VolumeKmsKeyId"] = settings.kms_key
        request["OutputDataConfig"]["KmsKeyId"] = settings.kms_key
    return request


def _stage_tags(manifest_digest: str, stage_index: int, settings: TrainingSettings) -> dict[str, str]:
    return {MANIFEST_TAG: manifest_digest, "atelier:lineage": settings.lineage,
            "atelier:stage": settings.stages[stage_index].name,
            FINAL_STAGE_TAG: str(stage_index == len(settings.stages) - 1).lower()}


def training_job_request(name: str, manifest_uri: str, manifest_digest: str, stage_index: int,
                         steps_target: int, settings: TrainingSettings, exclusions_uri: str = "") -> dict[str, Any]:
    """CreateTrainingJob's request; `manifest_uri` lists image shards or their latent twins, and
    `exclusions_uri` (if any) is the manifest JSON for the `manifest` channel."""
    stage = settings.stages[stage_index]
    return _job_request(
        name, manifest_uri, stage_hyperparameters(stage, steps_target), (stage.instance_type, stage.instance_count),
        "training/",
        # One prefix per lineage: a retried job and the lineage's next job resume from it.
        f"s3://{settings.models_bucket}/checkpoints/{settings.lineage}/",
        _stage_tags(manifest_digest, stage_index, settings), settings, exclusions_uri)


def encode_job_name(training_job: str) -> str:
    return f"{training_job}{ENCODE_SUFFIX}"


def encoded_prefix(training_job: str) -> str:
    """Where the encode job's CheckpointConfig puts the latent shards: `<this>latents/<identity>-r<res>/`."""
    return f"{ENCODED_PREFIX}{training_job}/"


def encode_job_request(training_job: str, manifest_uri: str, manifest_digest: str, stage_index: int,
                       settings: TrainingSettings, exclusions_uri: str = "") -> dict[str, Any]:
    """The training image with task=encode on one encode instance, for the stage's resolution and
    models; its latent shards reach S3 through CheckpointConfig (trainer/encode.py). It reads the
    training job's `manifest` channel (`exclusions_uri`): excluded samples are never encoded."""
    stage = settings.stages[stage_index]
    hyperparameters = {"task": "encode", **{k: v for k, v in stage.hyperparameters.items() if k in ENCODE_HYPERPARAMETERS}}
    tags = {**_stage_tags(manifest_digest, stage_index, settings), FINAL_STAGE_TAG: "false", ROLE_TAG: "encode",
            "atelier:training-job": training_job}
    request = _job_request(encode_job_name(training_job), manifest_uri, hyperparameters,
                           (settings.encode_instance_type, 1), ENCODED_PREFIX,
                           f"s3://{settings.models_bucket}/{encoded_prefix(training_job)}", tags, settings,
                           exclusions_uri)
    request["AlgorithmSpecification"].pop("MetricDefinitions")  # no loss to chart
    return request


def latent_manifest_file(manifest: Manifest, bucket: str, prefix: str, keys: list[str]) -> list[Any]:
    """A ManifestFile of the latent twins of the manifest's shards, from the keys found under
    `<prefix>latents/`: one encoding directory, and every shard's twin in it (a twin holds fewer
    samples than its shard where the manifest excludes some: only its presence is checked)."""
    relative = [s.key.removeprefix(manifest.prefix) for s in manifest.shards]
    found: dict[str, set[str]] = {}
    for key in keys:
        encoding, _, path = key.removeprefix(f"{prefix}latents/").partition("/")
        if path.endswith(".tar") and not path.rsplit("/", 1)[-1].startswith("."):  # not a .tmp- part
            found.setdefault(encoding, set()).add(path)
    if len(found) != 1:
        raise EncodeIncomplete(f"expected one encoding under s3://{bucket}/{prefix}latents/, found "
                               f"{len(found)} ({', '.join(sorted(found)) or 'none'})")
    [(encoding, paths)] = found.items()
    missing = [path for path in relative if path not in paths]
    if missing:
        raise EncodeIncomplete(f"{len(missing)} of {len(relative)} shards have no latent shard under "
                               f"s3://{bucket}/{prefix}latents/{encoding}/ (first: {missing[0]})")
    return [{"prefix": f"s3://{bucket}/{prefix}latents/{encoding}/"}, *relative]


# --- orchestration: events in -------------------------------------------------------------------

def on_shard_sealed(shard: ShardSealed, settings: TrainingSettings) -> Decision:
    if not aws.put_item_if_absent(settings.table, records.shard_item(shard)):
        item = aws.get_item(settings.table, records.shard_pk(shard.shard_id)) or {}
        if item.get("status") != "pending":
            # A redelivery after the claim: make sure the claimed job really runs.
            advance(settings)
            return Decision("already-claimed", item.get("manifest_job"))
    return advance(settings)


def on_job_finished(name: str, status: str, reason: str | None, settings: TrainingSettings) -> Decision:
    """A job reached Completed, Failed or Stopped: settle its shards, free the lineage, go on."""
    job = aws.get_item(settings.table, records.job_pk(name))
    if job is None or job.get("lineage", settings.lineage) != settings.lineage:
        return Decision("not-ours", name)
    if job.get("role") == "encode":
        return on_encode_finished(job, status, reason, settings)
    if aws.update_item(settings.table, records.job_pk(name), "SET settled = :s, #st = :status, failure_reason = :r",
                       {":s": status, ":status": status, ":r": reason or ""},
                       condition="attribute_not_exists(settled)", names={"#st": "status"}):
        _settle(job, status, settings)
    if status == "Completed":  # every delivery (idempotent), so a crash after settling is made good
        attribution.record_model(name, settings)
    return advance(settings)


def on_encode_finished(job: dict[str, Any], status: str, reason: str | None, settings: TrainingSettings) -> Decision:
    """An encode job ended: Completed with every latent shard lets its training job start on them;
    anything else fails the training job (its shards return to pending, the lineage goes on)."""
    name, training_job = job["pk"].removeprefix("JOB#"), job["for_job"]
    aws.update_item(settings.table, job["pk"], "SET settled = :s, #st = :status, failure_reason = :r",
                    {":s": status, ":status": status, ":r": reason or ""},
                    condition="attribute_not_exists(settled)", names={"#st": "status"})
    if status != "Completed":
        on_job_finished(training_job, "Failed", f"encode job {name} {status}: {reason or 'no reason given'}", settings)
        return Decision("encode-failed", training_job)
    try:
        latents_uri = _write_latent_manifest(training_job, settings)
    except EncodeIncomplete as exc:
        on_job_finished(training_job, "Failed", f"encode job {name}: {exc}", settings)
        return Decision("encode-failed", training_job)
    aws.update_item(settings.table, records.job_pk(training_job), "SET latents = :u", {":u": latents_uri},
                    condition="attribute_exists(pk)")
    logger.info("latent shards ready", extra={"job": training_job, "encode_job": name, "latents": latents_uri})
    advance(settings)
    return Decision("encoded", training_job)


def _write_latent_manifest(training_job: str, settings: TrainingSettings) -> str:
    """`manifests/<job>.latents.manifest` from what the encode job uploaded; its URI."""
    record = aws.get_item(settings.table, records.job_pk(training_job)) or {}
    base = record.get("base", training_job)
    manifest = Manifest.model_validate_json(aws.read_object(settings.data_bucket, f"{MANIFEST_PREFIX}{base}.json"))
    prefix = encoded_prefix(training_job)
    keys = [item["Key"] for item in aws.list_objects(settings.models_bucket, f"{prefix}latents/")]
    listing = latent_manifest_file(manifest, settings.models_bucket, prefix, keys)
    key = f"{MANIFEST_PREFIX}{training_job}.latents.manifest"
    aws.write_object(settings.data_bucket, key, json.dumps(listing).encode(), "application/json")
    return f"s3://{settings.data_bucket}/{key}"


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
    if lock.get("queue"):
        return _start_queued(lock["queue"][0], settings)
    return _claim_next(settings, lock, queue=False)


def _lineage(settings: TrainingSettings) -> dict[str, Any]:
    pk = f"LINEAGE#{settings.lineage}"
    aws.put_item_if_absent(settings.table, {"pk": pk, "kind": "lineage", "sequence": 0, "steps_done": 0,
                                            "queue": [], "running_job": ""})
    return aws.get_item(settings.table, pk) or {}


def _claim_next(settings: TrainingSettings, lock: dict[str, Any], queue: bool) -> Decision:
    pending = [ShardSealed.model_validate_json(i["record"])
               for i in aws.query_index(settings.table, records.PENDING_INDEX, records.PENDING_SHARDS)]
    trained = [ShardRef.model_validate_json(i["ref"])
               for i in aws.query_index(settings.table, records.PENDING_INDEX, TRAINED_SHARDS)]
    sequence = int(lock["sequence"]) + 1
    screen = _Screen(pending, trained, settings) if len(pending) >= settings.quota else None
    manifest = manifest_from(pending, trained, settings, sequence, screen)
    if manifest is None:
        return Decision("waiting", pending=len(pending))
    name = job_name_for(manifest)
    _write_manifest(manifest, name, settings)
    if not _claim(manifest, name, int(lock["sequence"]), int(lock["steps_done"]), queue, settings):
        return Decision("already-claimed", pending=len(pending))
    if screen:  # the shards this manifest left out whole, with why, leave the pending index
        _exclude_shards(screen.verdicts, {s.shard_id for s in pending}, settings)
    if queue:
        logger.info("manifest queued behind the running job", extra={"job": name})
        return Decision("queued", name, pending=len(pending))
    _ensure_started(name, settings)
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
            aws.update_item(settings.table, records.shard_pk(shard_id),
                            "SET #s = :excluded, excluded_reason = :r REMOVE gsi1pk, gsi1sk",
                            {":excluded": "excluded", ":r": verdict.left_out[0].reason, ":pending": "pending"},
                            condition="#s = :pending", names={"#s": "status"})


def _write_manifest(manifest: Manifest, name: str, settings: TrainingSettings) -> None:
    """Deterministic content under the job's name: writing it twice is harmless."""
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.json",
                     manifest.model_dump_json(indent=1).encode(), "application/json")
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.manifest",
                     json.dumps(manifest_file(manifest)).encode(), "application/json")


def _claim(manifest: Manifest, name: str, sequence: int, steps_done: int, queue: bool,
           settings: TrainingSettings) -> bool:
    """One transaction: the new shards claimed, the job recorded, the lineage lock taken or queued."""
    shard_updates = [(records.shard_pk(s.shard_id), "SET #s = :claimed, manifest_job = :job REMOVE gsi1pk, gsi1sk",
                      "#s = :pending", {":claimed": "claimed", ":job": name, ":pending": "pending"})
                     for s in manifest.new_shards]
    lineage_update = (
        f"LINEAGE#{settings.lineage}",
        "SET #q = list_append(#q, :one), #seq = :next" if queue else "SET running_job = :job, #seq = :next",
        ("running_job <> :empty AND #seq = :seq" if queue else "running_job = :empty AND #seq = :seq"),
        {":one": [name], ":next": sequence + 1, ":seq": sequence, ":empty": ""} if queue
        else {":job": name, ":next": sequence + 1, ":seq": sequence, ":empty": ""},
    )
    job = {**records.job_item(name, f"{MANIFEST_PREFIX}{name}.json", [s.shard_id for s in manifest.new_shards],
                              datetime.now(timezone.utc).isoformat(timespec="seconds")),
           "status": "Queued" if queue else "Requested", "lineage": settings.lineage, "digest": manifest.digest,
           "stage": 0, "base": name, "steps_base": steps_done, "replay": [s.shard_id for s in manifest.shards if s.role == "replay"],
           "sequence": manifest.sequence, "excludes": manifest.excluded,
           "encode": bool(settings.encode_instance_type)}  # decided once: a settings change never strands a claimed job
    return aws.transact_updates(settings.table, [*shard_updates, lineage_update], [job],
                                names={"#s": "status", "#q": "queue", "#seq": "sequence"})


def _start_queued(name: str, settings: TrainingSettings) -> Decision:
    """The queue's head becomes the running job (conditional: only one invocation does it)."""
    taken = aws.update_item(
        settings.table, f"LINEAGE#{settings.lineage}", "SET running_job = :job REMOVE #q[0]",
        {":job": name, ":empty": ""}, condition="running_job = :empty AND #q[0] = :job", names={"#q": "queue"})
    if taken:
        aws.update_item(settings.table, records.job_pk(name), "SET #s = :s, steps_base = :b", {
            ":s": "Requested", ":b": int(_lineage(settings)["steps_done"])}, names={"#s": "status"})
        _ensure_started(name, settings)
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
    aws.put_item_if_absent(settings.table, {**carried, "pk": records.job_pk(name), "status": "Requested",
                                            "stage": stage, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    aws.update_item(settings.table, f"LINEAGE#{settings.lineage}", "SET running_job = :next",
                    {":next": name, ":job": job["pk"].removeprefix("JOB#")}, condition="running_job = :job")
    _ensure_started(name, settings)


def _mark_trained(job: dict[str, Any], settings: TrainingSettings) -> None:
    manifest = Manifest.model_validate_json(aws.read_object(settings.data_bucket, job["manifest"]))
    for shard in manifest.new_shards:
        aws.update_item(settings.table, records.shard_pk(shard.shard_id),
                        "SET #s = :trained, gsi1pk = :p, gsi1sk = :k, #ref = :ref",
                        {":trained": "trained", ":p": TRAINED_SHARDS, ":k": shard.shard_id,
                         ":ref": shard.model_dump_json()}, names={"#s": "status", "#ref": "ref"})
    target = _steps_target(job, len(settings.stages) - 1, settings)
    aws.update_item(settings.table, f"LINEAGE#{settings.lineage}", "SET steps_done = :t", {":t": target})


def _return_to_pending(job: dict[str, Any], settings: TrainingSettings) -> None:
    """A failed or stopped job loses no shard: each goes back to the pending index."""
    name = job.get("base") or job["pk"].removeprefix("JOB#")  # shards name the manifest's first job
    for shard_id in job.get("shards", []):
        item = aws.get_item(settings.table, records.shard_pk(shard_id)) or {}
        shard = ShardSealed.model_validate_json(item["record"])
        aws.update_item(settings.table, records.shard_pk(shard_id),
                        "SET #s = :pending, gsi1pk = :p, gsi1sk = :k REMOVE manifest_job",
                        {":pending": "pending", ":p": records.PENDING_SHARDS, ":k": f"{shard.sealed_at}#{shard_id}",
                         ":job": name}, condition="manifest_job = :job", names={"#s": "status"})


def _steps_target(job: dict[str, Any], stage: int, settings: TrainingSettings) -> int:
    return int(job.get("steps_base", 0)) + sum(s.steps for s in settings.stages[:stage + 1])


def _ensure_started(name: str, settings: TrainingSettings) -> None:
    """CreateTrainingJob for a recorded job; an existing job of that name must be ours."""
    job = aws.get_item(settings.table, records.job_pk(name))
    if job is None or job.get("status") not in ("Requested", "InProgress"):
        return
    stage = int(job.get("stage", 0))
    base = job.get("base", name)
    manifest_uri = f"s3://{settings.data_bucket}/{MANIFEST_PREFIX}{base}.manifest"
    exclusions_uri = f"s3://{settings.data_bucket}/{MANIFEST_PREFIX}{base}.json" if job.get("excludes") else ""
    if job.get("encode") and not job.get("latents"):
        _ensure_encoding(name, job, manifest_uri, exclusions_uri, settings)
        return
    train_uri = job.get("latents") or manifest_uri
    request = training_job_request(name, train_uri, job["digest"], stage, _steps_target(job, stage, settings), settings,
                                   exclusions_uri)
    if aws.create_training_job(request):
        logger.info("training job started", extra={"job": name, "stage": settings.stages[stage].name,
                                                   "latents": bool(job.get("latents"))})
        return
    _check_ours(name, name, train_uri, settings)


def _ensure_encoding(name: str, job: dict[str, Any], manifest_uri: str, exclusions_uri: str,
                     settings: TrainingSettings) -> None:
    """The training job's encode job runs (or has ended: then its end is handled now, in case its
    event was lost)."""
    encode_name = encode_job_name(name)
    aws.put_item_if_absent(settings.table, {
        "pk": records.job_pk(encode_name), "kind": "job", "role": "encode", "for_job": name, "status": "Requested",
        "lineage": settings.lineage, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    stage = int(job.get("stage", 0))
    if aws.create_training_job(encode_job_request(name, manifest_uri, job["digest"], stage, settings, exclusions_uri)):
        logger.info("encode job started", extra={"job": encode_name, "stage": settings.stages[stage].name})
        return
    existing = _check_ours(encode_name, name, manifest_uri, settings)
    encode_record = aws.get_item(settings.table, records.job_pk(encode_name)) or {}
    if existing["TrainingJobStatus"] in {"Completed", "Failed", "Stopped"} and "settled" not in encode_record:
        on_encode_finished(encode_record, existing["TrainingJobStatus"], existing.get("FailureReason"), settings)


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
