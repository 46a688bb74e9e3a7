"""What every model learned from, and which samples a manifest must leave out (docs/provenance.md).

- Screening: the manifest builder asks `screen_shard` which samples of a shard the registry's
  terms and the takedowns (core.partners.licensing) leave out; only shards with an affected partner are
  read (their index sidecar, then the affected samples' records for their licenses).
- Lineage: a model (a training job) learned from every manifest its lineage trained before it,
  since a lineage's jobs resume one checkpoint prefix, and from its own manifest through every
  stage up to its own. `lineage_of` lists those jobs, manifests, shards and sample records.
- Audit: `affected_by` lists the jobs whose lineage holds samples a takedown covers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Protocol

from contracts import pipeline_table, s3_layout
from contracts.messages import Frozen, LeftOut, Manifest, Sample, ShardRef
from core import aws
from core.partners.licensing import Revocation, Rules
from core.start_training.pretrained import PretrainedBase

LINEAGE_SCHEMA = 2  # 2: the pretrained base and the VAE
NOT_STARTED = ("Queued",)  # a queued manifest has trained nothing yet
# jobs run for a training job on its manifest (its encode job, the lineage's autoencoder job): what they
# learned from is its manifest, so they are no model of their own here
HELPER_ROLES = ("encode", "autoencoder", "tokenizer")


class Places(Protocol):
    """Where the pipeline keeps things (TrainingSettings has these; the CLI builds one from the stack)."""

    table: str
    data_bucket: str
    models_bucket: str


@dataclass(frozen=True)
class Stack:
    table: str
    data_bucket: str
    models_bucket: str


class UnknownModel(LookupError):
    """No training job of that name in the pipeline table."""


# --- reading shards and samples -------------------------------------------------------------------

def shard_members(bucket: str, shard_id: str) -> list[tuple[str, str]] | None:
    """(sample key, partner) of every sample of a shard, from its index sidecar; None without one."""
    key = s3_layout.index_key(shard_id)
    if aws.head_object(bucket, key) is None:
        return None
    index = json.loads(aws.read_object(bucket, key))
    return [(entry["key"], entry.get("partner", "")) for entry in index["samples"]]


def sample_records(table: str, keys: Iterable[str]) -> dict[str, Sample]:
    """The ingest records of these samples (absent ones are left out)."""
    found = aws.batch_get_items(table, [pipeline_table.sample_pk(k) for k in keys], ["pk", "record"])
    return {pipeline_table.sample_sha256(item["pk"]): Sample.model_validate_json(item["record"])
            for item in found.values()}


# --- screening: what a manifest leaves out ------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """A shard's samples left out (each with its reason), or the whole shard (`whole`)."""

    left_out: tuple[LeftOut, ...] = ()
    whole: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(sorted(entry.sha256 for entry in self.left_out if entry.sha256))


def screen_shard(shard: ShardRef, rules: Rules, bucket: str, table: str) -> Verdict:
    """Which samples of the shard the terms and takedowns leave out; the whole shard when none is left."""
    affected = {p for p in shard.partners if rules.affects(p)}
    if not affected:
        return Verdict()
    members = shard_members(bucket, shard.shard_id)
    if members is None:  # no index to tell samples apart: leave the shard out rather than guess
        reasons = sorted({rules.partner_reason(p) or f"{p}: terms or takedowns apply" for p in affected})
        return Verdict((LeftOut(shard_id=shard.shard_id, reason="; ".join(reasons) + " (no index: whole shard)"),), True)
    wanted = [key for key, partner in members if partner in affected]
    found = sample_records(table, wanted)
    left_out = []
    for key, partner in members:
        if partner not in affected:
            continue
        license = found[key].license if key in found else ""
        reason = rules.reason(partner, license, key)
        if reason:
            left_out.append(LeftOut(shard_id=shard.shard_id, sha256=key, partner=partner, license=license, reason=reason))
    if left_out and len(left_out) == len(members):
        reasons = "; ".join(sorted({entry.reason for entry in left_out}))
        return Verdict((LeftOut(shard_id=shard.shard_id, reason=f"every sample left out: {reasons}"),), True)
    return Verdict(tuple(left_out))


# --- lineage ------------------------------------------------------------------------------------

class JobSource(Frozen):
    name: str
    stage: int
    status: str


class ShardSource(Frozen):
    shard_id: str
    key: str
    sha256: str  # the shard's digest
    role: str
    samples: int  # in the shard
    excluded: int  # of them left out by the manifest
    index_uri: str  # "" : the shard has no index, so its samples are not listed


class ManifestSource(Frozen):
    sequence: int
    digest: str
    uri: str
    jobs: tuple[JobSource, ...]
    shards: tuple[ShardSource, ...]
    left_out: tuple[LeftOut, ...] = ()


class SampleSource(Frozen):
    sha256: str
    partner: str
    license: str  # "" : no sample record found
    bucket: str  # the original upload
    key: str
    version_id: str
    shards: tuple[str, ...]
    manifests: tuple[int, ...]  # the sequences of the manifests that trained on it


class VaeSource(Frozen):
    """Where the model's frozen VAE came from."""

    source: Literal["autoencoder", "base", "random"]  # the lineage's autoencoder job, the base, or none (random)
    uri: str = ""  # autoencoder: its model.tar.gz ("" while it has not completed)
    autoencoder_job: str = ""


class TokenizerSource(Frozen):
    """Where the model's caption tokenizers came from."""

    # the lineage's tokenizer job, the base, or learned by the training job from its own captions
    source: Literal["tokenizer-job", "base", "learned"]
    uri: str = ""  # tokenizer-job: its model.tar.gz ("" while it has not completed)
    tokenizer_job: str = ""


class Lineage(Frozen):
    """lineage.json: everything one model learned from, and the pretrained parts it started from."""

    schema_version: int = LINEAGE_SCHEMA
    job: str
    lineage: str
    manifest: str  # the digest of the job's own manifest
    artifact: str
    manifests: tuple[ManifestSource, ...]  # oldest first; the last is the job's own
    samples: tuple[SampleSource, ...]  # each once, sorted by sha256
    pretrained: PretrainedBase | None = None  # the base (PretrainedModelUri) the job was claimed with
    vae: VaeSource | None = None  # None: recorded before schema 2
    tokenizer: TokenizerSource | None = None  # None: recorded before tokenizer jobs

    def covered_by(self, revocation: Revocation) -> list[SampleSource]:
        return [s for s in self.samples if revocation.covers(s.partner, s.license, s.sha256)]


def lineage_of(job_name: str, places: Places) -> Lineage:
    """The jobs, manifests, shards and samples a training job's model learned from."""
    job = aws.get_item(places.table, pipeline_table.job_pk(job_name))
    if job is None:
        raise UnknownModel(f"no training job {job_name!r} in the pipeline table")
    manifests: dict[str, Manifest] = {}

    def manifest_of(item: dict[str, Any]) -> Manifest:
        if item["manifest"] not in manifests:
            manifests[item["manifest"]] = Manifest.model_validate_json(aws.read_object(places.data_bucket, item["manifest"]))
        return manifests[item["manifest"]]

    def sequence_of(item: dict[str, Any]) -> int:
        return int(item["sequence"]) if "sequence" in item else manifest_of(item).sequence

    mine, stage = sequence_of(job), int(job.get("stage", 0))
    lineage_jobs = [i for i in aws.scan_prefix(places.table, pipeline_table.JOB_PREFIX)  # training jobs only
                    if i.get("lineage", "") == job.get("lineage", "") and i.get("role") not in HELPER_ROLES]
    chain = sorted((i for i in lineage_jobs
                    if (i["manifest"] == job["manifest"] and int(i.get("stage", 0)) <= stage)
                    or (sequence_of(i) < mine and i.get("status") not in NOT_STARTED)),
                   key=lambda i: (sequence_of(i), int(i.get("stage", 0))))
    members: dict[str, list[tuple[str, str]] | None] = {}
    sources: list[ManifestSource] = []
    used: dict[str, tuple[str, set[str], set[int]]] = {}  # sample key -> partner, shards, manifests
    for key in dict.fromkeys(i["manifest"] for i in chain):
        manifest = manifest_of(next(i for i in chain if i["manifest"] == key))
        jobs = tuple(JobSource(name=pipeline_table.job_name(i["pk"]), stage=int(i.get("stage", 0)),
                               status=i.get("status", ""))
                     for i in chain if i["manifest"] == key)
        shard_sources = []
        for shard in manifest.shards:
            if shard.shard_id not in members:
                members[shard.shard_id] = shard_members(manifest.bucket, shard.shard_id)
            excluded = set(manifest.exclude.get(shard.shard_id, ()))
            for sample, partner in members[shard.shard_id] or []:
                if sample not in excluded:
                    entry = used.setdefault(sample, (partner, set(), set()))
                    entry[1].add(shard.shard_id)
                    entry[2].add(manifest.sequence)
            indexed = members[shard.shard_id] is not None
            index_uri = s3_layout.uri(manifest.bucket, s3_layout.index_key(shard.shard_id)) if indexed else ""
            shard_sources.append(ShardSource(shard_id=shard.shard_id, key=shard.key, sha256=shard.sha256, role=shard.role,
                                             samples=shard.samples, excluded=len(excluded), index_uri=index_uri))
        sources.append(ManifestSource(sequence=manifest.sequence, digest=manifest.digest,
                                      uri=s3_layout.uri(places.data_bucket, key), jobs=jobs, shards=tuple(shard_sources),
                                      left_out=manifest.left_out))
    found = sample_records(places.table, used)
    samples = tuple(_sample_source(key, *used[key], found.get(key)) for key in sorted(used))
    base = PretrainedBase.model_validate_json(job["pretrained"]) if job.get("pretrained") else None
    return Lineage(job=job_name, lineage=job.get("lineage", ""), manifest=str(job.get("digest", "")),
                   artifact=s3_layout.output_uri(places.models_bucket, job_name, s3_layout.MODEL_ARCHIVE),
                   manifests=tuple(sources), samples=samples, pretrained=base, vae=vae_source(job, base),
                   tokenizer=tokenizer_source(job, base))


def vae_source(job: dict[str, Any], base: PretrainedBase | None) -> VaeSource:
    """The job's VAE: its lineage's autoencoder's (core.start_training.autoencoder_job), the base's, or a random one."""
    if job.get("autoencoder"):
        return VaeSource(source="autoencoder", uri=job.get("vae_uri", ""), autoencoder_job=job.get("autoencoder_job", ""))
    return VaeSource(source="base" if base and base.has_vae else "random")


def tokenizer_source(job: dict[str, Any], base: PretrainedBase | None) -> TokenizerSource:
    """The job's tokenizers: its lineage's tokenizer job's (core.start_training.tokenizer_job), the base's, or learned by the job."""
    if job.get("tokenizer"):
        return TokenizerSource(source="tokenizer-job", uri=job.get("tokenizer_uri", ""),
                               tokenizer_job=job.get("tokenizer_job", ""))
    return TokenizerSource(source="base" if base and base.has_tokenizer else "learned")


def _sample_source(key: str, partner: str, shard_ids: set[str], sequences: set[int], record: Sample | None) -> SampleSource:
    return SampleSource(sha256=key, partner=record.partner if record else partner, license=record.license if record else "",
                        bucket=record.bucket if record else "", key=record.key if record else "",
                        version_id=record.version_id if record else "", shards=tuple(sorted(shard_ids)),
                        manifests=tuple(sorted(sequences)))


def stored_lineage(job_name: str, places: Places) -> Lineage:
    """lineage.json beside the job's model, or (for a job not yet completed) worked out now."""
    stored = aws.read_json_if_exists(places.models_bucket, s3_layout.output_key(job_name, s3_layout.LINEAGE_FILE))
    return Lineage.model_validate(stored) if stored else lineage_of(job_name, places)


# --- the audit ----------------------------------------------------------------------------------

class Affected(Frozen):
    """A job whose model learned from samples a takedown covers (trained, or queued, before it)."""

    job: str
    status: str
    stage: int
    samples: int  # how many of the covered samples its lineage holds


def affected_by(revocation: Revocation, places: Places) -> list[Affected]:
    """Every job whose lineage holds a sample the takedown covers, oldest manifest first."""
    found = []
    for item in aws.scan_prefix(places.table, pipeline_table.JOB_PREFIX):
        if item.get("role") in HELPER_ROLES:  # their samples are their training job's
            continue
        name = pipeline_table.job_name(item["pk"])
        covered = stored_lineage(name, places).covered_by(revocation)
        if covered:
            order = (item.get("lineage", ""), int(item.get("sequence", 0)), int(item.get("stage", 0)), item.get("at", ""))
            found.append((order, Affected(job=name, status=item.get("status", ""), stage=int(item.get("stage", 0)),
                                          samples=len(covered))))
    return [affected for _, affected in sorted(found, key=lambda pair: (pair[0], pair[1].job))]
