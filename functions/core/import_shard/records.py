"""The import stage's records in the pipeline table: what became of one source tar (its report, in its
import record) and of a batch of them (the batch record the CLI writes, with the counts each tar adds)."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel

from contracts import pipeline_table
from contracts.messages import DEFAULT_NEAR_DUPLICATES, ImportShard, NearDuplicates
from core import aws

DUPLICATE_REASONS = ("duplicate", "near_duplicate")
# Near duplicates a tar's report names (all are counted): the report is one DynamoDB item (400 KB),
# and 100 of about 250 bytes keep it far from that.
LISTED_NEAR_DUPLICATES = 100


def record_pk(message: ImportShard) -> str:
    """The message's import record's key, in the table's layout."""
    return pipeline_table.import_shard_pk(message.batch_id, message.uri)


class NearDuplicate(BaseModel):
    """A sample of the tar near an earlier one: flagged and accepted, or left out."""

    key: str  # the sample's key in the tar
    sha256: str
    of: str  # the earlier sample's sha256 (SAMPLE#<of>)
    distance: int  # dHash bits
    colour_distance: int | None = None  # None: the earlier one has no colour signature (indexed before them)


class ShardReport(BaseModel):
    """What became of one source tar."""

    source: str
    status: Literal["imported", "empty", "rejected"]  # empty: it parsed, but no sample was new and valid
    reason: str | None = None  # why the whole tar was rejected
    detail: str = ""
    shard_id: str | None = None  # the pipeline shard it became
    samples_read: int = 0
    accepted: int = 0
    quarantined: dict[str, int] = {}  # reason -> samples (duplicates and dropped near duplicates included)
    near_duplicates_found: int = 0  # flagged (accepted) or dropped (in `quarantined` too), by the message's mode
    near_duplicate_samples: list[NearDuplicate] = []  # the first LISTED_NEAR_DUPLICATES of them
    captions_missing: int = 0  # accepted, flagged: no caption in the tar nor in the image
    size_mismatches: int = 0  # accepted, flagged: the .json's width/height are not the decoded image's
    truncated: bool = False  # the tar broke off; the samples before the break were kept
    source_stats: dict[str, Any] = {}  # img2dataset's own <shard>_stats.json counts, when present

    @property
    def duplicates(self) -> int:
        """Exact duplicates, left out (near duplicates are `near_duplicates_found`)."""
        return self.quarantined.get("duplicate", 0)

    @property
    def rejected(self) -> int:
        return sum(n for reason, n in self.quarantined.items() if reason not in DUPLICATE_REASONS)


def batch_item(batch_id: str, partner: str, license_id: str, source: str, shards_total: int,
               near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES) -> dict[str, Any]:
    return {"pk": pipeline_table.import_batch_pk(batch_id), "kind": "import", "batch_id": batch_id, "partner": partner,
            "license": license_id, "source": source, "shards_total": shards_total, "near_duplicates": near_duplicates,
            "created_at": now()}


# --- the batch, as the CLI reads it ---------------------------------------------------------------

class BatchReport(BaseModel):
    batch_id: str
    partner: str = ""
    license: str = ""
    source: str = ""
    created_at: str = ""
    near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES  # batches begun before the option: what they did
    shards_total: int = 0
    shards_done: int = 0
    shards_rejected: int = 0
    samples_read: int = 0
    samples_accepted: int = 0
    samples_duplicate: int = 0  # exact, left out
    samples_near_duplicate: int = 0  # flagged or left out, as `near_duplicates` says
    samples_rejected: int = 0
    captions_missing: int = 0
    size_mismatches: int = 0
    reasons: dict[str, int] = {}  # sample quarantine reason -> count
    shard_reasons: dict[str, int] = {}  # whole-tar rejection reason -> count
    shards: list[ShardReport] = []

    @property
    def finished(self) -> int:
        return self.shards_done + self.shards_rejected

    @property
    def rejections(self) -> dict[str, int]:
        """The reasons of `samples_rejected`: duplicates, exact or near, are counted apart."""
        return {reason: n for reason, n in self.reasons.items() if reason not in DUPLICATE_REASONS}

    @property
    def complete(self) -> bool:
        return self.shards_total > 0 and self.finished >= self.shards_total


def batch_report(table: str, batch_id: str, with_shards: bool = True) -> BatchReport | None:
    item = aws.get_item(table, pipeline_table.import_batch_pk(batch_id))
    if item is None:
        return None
    fields = {k: int(v) if isinstance(v, Decimal) else v for k, v in item.items() if k in BatchReport.model_fields}
    report = BatchReport(**fields,
                         reasons={k.removeprefix("reason_"): int(v) for k, v in item.items() if k.startswith("reason_")},
                         shard_reasons={k.removeprefix("shard_reason_"): int(v) for k, v in item.items()
                                        if k.startswith("shard_reason_")})
    if with_shards:
        report.shards = [ShardReport.model_validate_json(i["report"])
                         for i in aws.query_index(table, pipeline_table.PENDING_INDEX,
                                                  pipeline_table.import_batch_pk(batch_id))
                         if i.get("status") == "done"]
    return report


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
