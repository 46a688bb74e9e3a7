"""ImportFunction's settings: ingest's acceptance policy for every sample, the packer's shard machinery."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self

from core.ingest.settings import IngestSettings
from core.pack.settings import PackSettings


@dataclass(frozen=True)
class ImportSettings:
    ingest: IngestSettings
    pack: PackSettings
    chunk_bytes: int = 16 << 20  # accepted samples held before they are written as one segment

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self:
        env = os.environ if env is None else env
        # An import hands nothing to the pack queue and has no sidecars: it writes its shards itself
        # (docs/import.md), one per source tar, so no size policy applies either.
        ingest = IngestSettings.from_env({**env, "PACK_QUEUE_URL": "none", "PACK_LANES": "1",
                                          "SIDECAR_ORPHAN_GRACE_S": "0"})
        pack = PackSettings.from_env({**env, "SHARD_TARGET_BYTES": "0", "SHARD_MAX_SAMPLES": "0", "SHARD_MAX_AGE_S": "0",
                                      "PACK_LANES": "1"})
        return cls(ingest=ingest, pack=pack)
