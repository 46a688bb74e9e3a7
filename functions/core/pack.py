"""Pack stage: a batch of accepted samples -> one sealed WebDataset shard, announced once sealed.

Narrow for now: one shard per batch, built in memory. Order of side effects: shard object,
then sample records (`packed_in`), then the event. A redelivered batch rebuilds the same shard
(same samples, same id, same bytes) and re-announces shards its samples are already in, so a
crash at any point delays a sample but never loses or duplicates it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone

from aws_lambda_powertools import Logger

from core import aws, records, shards
from core.models import Sample, ShardSealed
from core.settings import PackSettings

logger = Logger(child=True)
EVENT_SOURCE = "atelier.pack"
SHARD_SEALED = "Shard Sealed"


@dataclass(frozen=True)
class PackResult:
    sealed: ShardSealed | None
    reannounced: tuple[str, ...]
    skipped: int


def pack_samples(samples: list[Sample], settings: PackSettings) -> PackResult:
    unpacked, packed_in = _split_by_packed(samples, settings)
    for shard_id in sorted(packed_in):
        _reannounce(shard_id, settings)
    sealed = _seal(unpacked, settings) if unpacked else None
    return PackResult(sealed, tuple(sorted(packed_in)), len(samples) - len(unpacked))


def _split_by_packed(samples: list[Sample], settings: PackSettings) -> tuple[list[Sample], set[str]]:
    unique = {s.sha256: s for s in samples}  # a batch can hold the same sample twice
    unpacked, packed_in = [], set()
    for sample in unique.values():
        item = aws.get_item(settings.table, records.sample_pk(sample.sha256)) or {}
        if item.get("packed_in"):
            packed_in.add(item["packed_in"])
        else:
            unpacked.append(sample)
    return unpacked, packed_in


def _seal(samples: list[Sample], settings: PackSettings) -> ShardSealed:
    body = shards.build_shard((s, aws.read_object(s.bucket, s.key)) for s in samples)
    shard_id = shards.shard_id_for(s.sha256 for s in samples)
    key = shards.shard_key(shard_id)
    aws.write_object(settings.data_bucket, key, body, content_type="application/x-tar")
    sealed = ShardSealed(
        shard_id=shard_id, bucket=settings.data_bucket, key=key,
        sha256=hashlib.sha256(body).hexdigest(), size=len(body), samples=len(samples),
        partners=sorted({s.partner for s in samples}),
        sealed_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
    )
    # The shard's record is written before samples point at it, so a re-announcement can read it.
    aws.put_item(settings.table, {"pk": records.sealed_pk(shard_id), "kind": "sealed", "record": sealed.model_dump_json()})
    for sample in samples:
        _mark_packed(sample, shard_id, settings)
    _announce(sealed, settings)
    return sealed


def _mark_packed(sample: Sample, shard_id: str, settings: PackSettings) -> None:
    claimed = aws.update_item(
        settings.table, records.sample_pk(sample.sha256), "SET packed_in = :s", {":s": shard_id},
        condition="attribute_not_exists(packed_in) OR packed_in = :s",
    )
    if not claimed:
        logger.warning("sample already packed elsewhere", extra={"sha256": sample.sha256, "shard": shard_id})


def _reannounce(shard_id: str, settings: PackSettings) -> None:
    item = aws.get_item(settings.table, records.sealed_pk(shard_id))
    if item:
        _announce(ShardSealed.model_validate_json(item["record"]), settings)


def _announce(sealed: ShardSealed, settings: PackSettings) -> None:
    aws.put_event(settings.event_bus, EVENT_SOURCE, SHARD_SEALED, sealed.model_dump_json())
    logger.info("shard sealed", extra={"shard": sealed.shard_id, "samples": sealed.samples, "bytes": sealed.size})
