"""The pipeline table's item layout: one string key `pk`, a sparse GSI `gsi1` for pending shards.

Every key is built here, and only here: a prefix names what an item is (`SAMPLE#`, `JOB#`, ...),
and the `*_name`/`*_of` functions read a name back out of a key.
"""

from __future__ import annotations

from typing import Any, Literal

from contracts.messages import Sample, ShardSealed, UploadRef

PENDING_SHARDS = "SHARDS#pending"
PENDING_INDEX = "gsi1"
REVOCATIONS = "REVOCATIONS"  # the sparse index partition of the takedowns (docs/provenance.md)
UploadStatus = Literal["accepted", "quarantined", "sidecar"]  # sidecar: core.ingest.sidecars says which fate
SIDECAR_WAITING = "waiting"  # a sidecar's record until its image is there; the sweep looks at it again
# Why an upload is quarantined (docs/metadata.md); `atelier status` counts them.
QUARANTINE_REASONS = ("empty", "truncated", "corrupt", "not_an_image", "unsupported_format", "too_small",
                      "bad_aspect", "too_many_pixels", "too_large", "unlicensed", "duplicate", "bad_key", "gone",
                      "bad_sidecar", "caption_too_long", "image_named_json", "orphan_sidecar", "sidecar_too_late")


SAMPLE_PREFIX = "SAMPLE#"
UPLOAD_PREFIX = "UPLOAD#"
SHARD_PREFIX = "SHARD#"
SEALED_PREFIX = "SEALED#"
JOB_PREFIX = "JOB#"
MODEL_PREFIX = "MODEL#"
ENDPOINT_PREFIX = "ENDPOINT#"
LINEAGE_PREFIX = "LINEAGE#"
PARTNER_PREFIX = "PARTNER#"
REVOKED_PREFIX = "REVOKED#"
IMPORT_PREFIX = "IMPORT#"
PACK_SHARD_PREFIX = "PACKSHARD#"
PHASH_PREFIX = "PHASH#"
PHASH_FULL_PREFIX = "PHASHFULL#"
TRAINED_SHARDS = "SHARDS#trained"  # the gsi1 partition of trained shards, the replay pool
PACK_HEAD = "PACK#head"  # lane 0's open-shard record (core.pack.journal); lane k > 0 is PACK#head#k


def pack_head_pk(lane: int) -> str:
    return PACK_HEAD if lane == 0 else f"{PACK_HEAD}#{lane}"


def sample_pk(sha256: str) -> str:
    return f"{SAMPLE_PREFIX}{sha256}"


def sample_sha256(pk: str) -> str:
    return pk.removeprefix(SAMPLE_PREFIX)


def upload_pk(bucket: str, key: str) -> str:
    return f"{UPLOAD_PREFIX}{bucket}/{key}"


def upload_key(pk: str) -> str:
    """The object key of an upload's record (its bucket left out)."""
    return pk.removeprefix(UPLOAD_PREFIX).split("/", 1)[1]


def shard_pk(shard_id: str) -> str:
    return f"{SHARD_PREFIX}{shard_id}"


def shard_id_of(pk: str) -> str:
    return pk.removeprefix(SHARD_PREFIX)


def sealed_pk(shard_id: str) -> str:
    """The pack stage's own record of a shard it sealed (read to re-announce it)."""
    return f"{SEALED_PREFIX}{shard_id}"


def pack_shard_pk(shard_id: str) -> str:
    """How far the seal of one shard has got (core.pack.journal)."""
    return f"{PACK_SHARD_PREFIX}{shard_id}"


def job_pk(job_name: str) -> str:
    """A job the pipeline started: core.start_training.starter's, but for `model_data` (core.deploy.records)."""
    return f"{JOB_PREFIX}{job_name}"


def job_name(pk: str) -> str:
    return pk.removeprefix(JOB_PREFIX)


def lineage_pk(lineage: str) -> str:
    """A lineage's lock, sequence, queue, brake and VAE (core.start_training.starter)."""
    return f"{LINEAGE_PREFIX}{lineage}"


def lineage_name(pk: str) -> str:
    return pk.removeprefix(LINEAGE_PREFIX)


def model_pk(model_name: str) -> str:
    """A deploy candidate: its evaluation, the gate's decision and its rollout (core.deploy.records)."""
    return f"{MODEL_PREFIX}{model_name}"


def endpoint_pk(endpoint_name: str) -> str:
    """What an endpoint is meant to serve, its order and its rollout history (core.deploy.rollout)."""
    return f"{ENDPOINT_PREFIX}{endpoint_name}"


def partner_pk(partner_id: str) -> str:
    """A partner's registry entry: its licenses and terms (core.partners.licensing)."""
    return f"{PARTNER_PREFIX}{partner_id}"


def import_batch_pk(batch_id: str) -> str:
    """An import batch (core.import_shard.records); also the gsi1 partition of its source tars."""
    return f"{IMPORT_PREFIX}{batch_id}"


def import_shard_pk(batch_id: str, uri: str) -> str:
    """One source tar of an import batch, with its report."""
    return f"{import_batch_pk(batch_id)}#{uri}"


def phash_band(band: int, band_hex: str) -> str:
    """The first half of a near-duplicate index key: one 16-bit band of the hash (core.ingest.dedup)."""
    return f"{PHASH_PREFIX}{band}#{band_hex}"


def phash_pk(band: int, band_hex: str, sub: int, sub_hex: str) -> str:
    """A near-duplicate index key: a band, and one 12-bit sub-band of the rest of the hash."""
    return f"{phash_band(band, band_hex)}#{sub}#{sub_hex}"


def phash_full_pk(phash_key: str) -> str:
    """The counter of full index keys of the (band, sub-band) that `phash_key` belongs to."""
    _, band, _, sub, _ = phash_key.split("#")
    return f"{PHASH_FULL_PREFIX}{band}#{sub}"


REDRIVE_PREFIX = "REDRIVE#"  # RedriveFunction may write only these items (template.yaml: dynamodb:LeadingKeys)


def redrive_pk(queue: str, identity: str) -> str:
    """The redrive ledger of one dead letter: how often it was redriven, and when (core.redrive.redriver)."""
    return f"{REDRIVE_PREFIX}{queue}#{identity}"


def revocation_pk(revocation_id: str) -> str:
    return f"{REVOKED_PREFIX}{revocation_id}"


def revocation_item(revocation_id: str, at: str, record: str) -> dict[str, Any]:
    """A takedown (core.partners.licensing.Revocation), listed in the sparse index partition `REVOCATIONS`."""
    return {"pk": revocation_pk(revocation_id), "kind": "revocation", "gsi1pk": REVOCATIONS,
            "gsi1sk": f"{at}#{revocation_id}", "record": record}


def sample_item(sample: Sample, pack_lane: int | None = None) -> dict[str, Any]:
    """A sample's record; `pack_lane`, the lane its first ingest chose (core.pack.lanes), is kept
    with it so that every later delivery of the sample is packed in that lane."""
    return {"pk": sample_pk(sample.sha256), "kind": "sample", "record": sample.model_dump_json(),
            "partner": sample.partner, **({"pack_lane": pack_lane} if pack_lane is not None else {})}


def upload_item(upload: UploadRef, status: UploadStatus, partner: str, sha256: str | None = None,
                reason: str | None = None, detail: str | None = None, duplicate_of: str | None = None,
                duplicate_of_key: str | None = None, sidecar_etag: str = "", image: str | None = None) -> dict[str, Any]:
    """What happened to one upload; keyed by the object, so a redelivery finds it.

    `detail` is for the partner (their report shows it); `duplicate_of_key`, the key of the first
    upload of the same bytes (maybe another partner's), is for operators only. An image's record
    keeps the ETag of the sidecar it read; a sidecar's names its `image`.
    """
    # A sidecar's own fate (waiting, read, applied) is kind "sidecar": `atelier status` and the
    # partner report count uploads; a quarantined sidecar is an upload refused like any other.
    kind = "sidecar" if status == "sidecar" else "upload"
    return {"pk": upload_pk(upload.bucket, upload.key), "kind": kind, "status": status, "partner": partner,
            "at": upload.event_time, "etag": upload.etag, "version_id": upload.version_id, "sha256": sha256,
            "reason": reason, "detail": (detail or "")[:500] or None, "duplicate_of": duplicate_of,
            "duplicate_of_key": duplicate_of_key, "sidecar_etag": sidecar_etag or None, "image": image}


def shard_item(shard: ShardSealed) -> dict[str, Any]:
    """A new shard waits in the sparse `gsi1` partition until a job claims it."""
    return {"pk": shard_pk(shard.shard_id), "kind": "shard", "status": "pending",
            "gsi1pk": PENDING_SHARDS, "gsi1sk": f"{shard.sealed_at}#{shard.shard_id}",
            "record": shard.model_dump_json()}


def job_item(job_name: str, manifest_key: str, shard_ids: list[str], at: str) -> dict[str, Any]:
    return {"pk": job_pk(job_name), "kind": "job", "status": "Requested", "manifest": manifest_key,
            "shards": shard_ids, "at": at}
