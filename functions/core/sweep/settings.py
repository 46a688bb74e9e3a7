"""SweepFunction's settings: which uploads the sweep looks at, and when it defers."""

from __future__ import annotations

from pydantic import Field

from core.errors import ConfigError
from core.ingest.settings import ORPHAN_GRACE_S
from core.settings import StageSettings, settings


@settings
class SweepSettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    uploads_bucket: str = Field(validation_alias="UPLOADS_BUCKET")
    uploads_queue_url: str = Field(validation_alias="UPLOADS_QUEUE_URL")
    # an upload younger than this may still have its notification on the way
    grace_s: int = Field(600, ge=0, validation_alias="SWEEP_GRACE_S")  # (a tuning knob, as below)
    # uploads older than this are `atelier audit`'s business, not the sweep's (a tuning knob)
    lookback_s: int = Field(86400, ge=1, validation_alias="SWEEP_LOOKBACK_S")
    # UploadsQueue deeper than this: ingest is behind, so uploads without a record are expected and
    # re-driving them would only add duplicates to the backlog; the run is deferred (a tuning knob)
    max_queue_depth: int = Field(1000, ge=1, validation_alias="SWEEP_MAX_QUEUE_DEPTH")
    # A sidecar still waiting for its image this long after it was written is re-driven, so ingest
    # records it as an orphan (core.ingest.sidecars)
    sidecar_orphan_grace_s: int = Field(ORPHAN_GRACE_S, ge=0, validation_alias="SIDECAR_ORPHAN_GRACE_S")

    def check(self) -> None:
        if self.lookback_s <= self.grace_s:
            raise ConfigError(f"SWEEP_LOOKBACK_S={self.lookback_s} is outside {self.grace_s + 1}..inf "
                              "(it must look past the grace period)")

