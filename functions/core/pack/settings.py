"""PackFunction's settings: when a shard is sealed, and how many are packed side by side."""

from __future__ import annotations

from pydantic import Field

from core.pack.lanes import MAX_LANES
from core.settings import StageSettings, settings


@settings
class PackSettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    data_bucket: str = Field(validation_alias="DATA_BUCKET")
    event_bus: str = Field(validation_alias="EVENT_BUS_NAME")
    # A shard is sealed before it grows past this (1 GiB), when it holds this many samples, or at most this long
    # after its first sample (by the minutely timer), full or not, so a trickle reaches training: tuning knobs
    shard_target_bytes: int = Field(1 << 30, ge=0, validation_alias="SHARD_TARGET_BYTES")
    shard_max_samples: int = Field(10000, ge=0, validation_alias="SHARD_MAX_SAMPLES")
    shard_max_age_s: int = Field(3600, ge=0, validation_alias="SHARD_MAX_AGE_S")
    lanes: int = Field(ge=1, le=MAX_LANES, validation_alias="PACK_LANES")  # open shards packed side by side
    # How long a seal is leased to the invocation finishing it (core.pack.journal.claim_seal): the
    # handler sets the invocation's remaining time; 900 s is Lambda's longest.
    seal_lease_s: float = 900.0
    # S3's rules and the packer's memory, not deployment choices (tests lower them to keep moto fast).
    min_part_bytes: int = 5 << 20  # S3's smallest part but the last
    part_bytes: int = 16 << 20  # the one part a streaming upload holds in memory
