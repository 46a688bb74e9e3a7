"""The pack stage's durable state in the pipeline table (docs/pack.md).

Each pack lane's head (`PACK#head` for lane 0, `PACK#head#<k>`: core.pack.lanes) holds its open
shard (its committed segments and counts), the last committed segment whose samples may not all
be marked `packed_in` yet (`pending`), and the ids of its shards being sealed. Every change to what
a shard holds is a conditional write on the head's `version`, so two packers never both append to
one lane: the one that read a stale head fails and reads it again. `PACKSHARD#<id>` records how
far the seal of one shard has got, one conditional step at a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from contracts import pipeline_table
from contracts.messages import Frozen, ShardSealed
from core import aws
from core.pack.segments import Segment

SealStatus = Literal["sealing", "indexed", "composed", "announced", "done"]
_NAMES = {"#v": "version", "#o": "open"}


class OpenShard(Frozen):
    shard_id: str
    opened_at: str
    bytes: int = 0
    samples: int = 0
    segments: tuple[Segment, ...] = ()
    partners: dict[str, int] = {}
    aspects: dict[str, int] = {}

    def appended(self, segment: Segment, partners: Counter[str], aspects: Counter[str]) -> "OpenShard":
        return self.model_copy(update={
            "bytes": self.bytes + segment.size, "samples": self.samples + segment.samples,
            "segments": (*self.segments, segment),
            "partners": dict(sorted((Counter(self.partners) + partners).items())),
            "aspects": dict(sorted((Counter(self.aspects) + aspects).items())),
        })


class Pending(Frozen):
    """The last committed segment: its samples' `packed_in` marks may still be missing."""

    shard_id: str
    segment: Segment


@dataclass(frozen=True)
class Head:
    version: int
    open: OpenShard | None
    pending: Pending | None
    sealing: frozenset[str]
    lane: int = 0

    @property
    def pk(self) -> str:
        return pipeline_table.pack_head_pk(self.lane)


class SealState(Frozen):
    shard: OpenShard
    status: SealStatus
    upload_id: str = ""
    sealed: ShardSealed | None = None
    lane: int = 0  # whose head lists the shard under `sealing`


# --- the head -----------------------------------------------------------------------------------

def load_head(table: str, lane: int = 0) -> Head:
    return _head(aws.get_item(table, pipeline_table.pack_head_pk(lane)) or {}, lane)


def load_heads(table: str, lanes: int) -> list[Head]:
    """The heads of lanes 0 .. lanes - 1, in one consistent batch read."""
    items = aws.batch_get_items(table, [pipeline_table.pack_head_pk(lane) for lane in range(lanes)])
    return [_head(items.get(pipeline_table.pack_head_pk(lane), {}), lane) for lane in range(lanes)]


def _head(item: dict[str, Any], lane: int) -> Head:
    return Head(
        version=int(item.get("version", 0)),
        open=OpenShard.model_validate_json(item["open"]) if item.get("open") else None,
        pending=Pending.model_validate_json(item["pending"]) if item.get("pending") else None,
        sealing=frozenset(item.get("sealing", ())),
        lane=lane,
    )


def append(table: str, head: Head, shard: OpenShard, pending: Pending) -> bool:
    """Commit a segment: the new open shard and its pending marks, if nobody committed since `head`."""
    values = {":n": head.version + 1, ":o": shard.model_dump_json(), ":p": pending.model_dump_json(),
              ":k": "pack-head"}
    if head.version:
        values[":v"] = head.version
    return aws.update_item(table, head.pk, "SET #v = :n, #o = :o, pending = :p, kind = :k", values,
                           condition="#v = :v" if head.version else "attribute_not_exists(#v)", names=_NAMES)


def clear_pending(table: str, head: Head) -> bool:
    """Forget `pending` once its marks are written, unless a newer commit replaced it."""
    return aws.update_item(table, head.pk, "REMOVE pending", {":v": head.version},
                           condition="#v = :v", names={"#v": "version"})


def begin_seal(table: str, head: Head, requested_at: str) -> bool:
    """Close the open shard: the head lets go of it and a seal record takes it, in one transaction."""
    assert head.open is not None
    state = SealState(shard=head.open, status="sealing", lane=head.lane)
    return aws.transact_updates(
        table,
        [(head.pk, "SET #v = :n REMOVE #o ADD sealing :ids", "#v = :v",
          {":v": head.version, ":n": head.version + 1, ":ids": {head.open.shard_id}})],
        [{"pk": pipeline_table.pack_shard_pk(head.open.shard_id), "kind": "pack-shard", "status": "sealing",
          "state": state.model_dump_json(), "requested_at": requested_at}],
        names=_NAMES)


def forget_sealing(table: str, lane: int, shard_id: str) -> None:
    aws.update_item(table, pipeline_table.pack_head_pk(lane), "DELETE sealing :ids", {":ids": {shard_id}})


# --- one seal -----------------------------------------------------------------------------------

def load_seal(table: str, shard_id: str) -> SealState | None:
    item = aws.get_item(table, pipeline_table.pack_shard_pk(shard_id))
    return SealState.model_validate_json(item["state"]) if item else None


def advance(table: str, state: SealState, status: SealStatus, **changes: Any) -> bool:
    """Move one seal a step on, if nobody moved it since `state`."""
    new = state.model_copy(update={"status": status, **changes})
    return aws.update_item(
        table, pipeline_table.pack_shard_pk(state.shard.shard_id), "SET #s = :new, #st = :state",
        {":old": state.status, ":new": status, ":state": new.model_dump_json()},
        condition="#s = :old", names={"#s": "status", "#st": "state"})


def claim_seal(table: str, shard_id: str, owner: str, until_ms: int, now_ms: int) -> bool:
    """Lease one seal to `owner` until `until_ms` (epoch milliseconds), unless another owner holds it now.

    Two invocations composing one shard at once would send the same parts to one multipart upload:
    wasted work on S3, and with SSE-KMS (ETags that are not the bytes' MD5) one's completion can
    name parts the other replaced. The lease ends with the holder's invocation (its deadline), so a
    crashed holder delays the seal only until then."""
    return aws.update_item(
        table, pipeline_table.pack_shard_pk(shard_id), "SET sealer = :me, sealer_until = :until",
        {":me": owner, ":until": until_ms, ":now": now_ms},
        condition="attribute_exists(pk) AND (attribute_not_exists(sealer_until) OR sealer_until < :now "
                  "OR sealer = :me)")


def release_seal(table: str, shard_id: str, owner: str) -> None:
    aws.update_item(table, pipeline_table.pack_shard_pk(shard_id), "REMOVE sealer, sealer_until", {":me": owner},
                    condition="sealer = :me")


def set_upload(table: str, state: SealState, upload_id: str) -> bool:
    """Record the shard's multipart upload, if no other sealer recorded one since `state`."""
    new = state.model_copy(update={"upload_id": upload_id})
    return aws.update_item(
        table, pipeline_table.pack_shard_pk(state.shard.shard_id), "SET #st = :state",
        {":state": new.model_dump_json(), ":old": state.model_dump_json()},
        condition="#st = :old", names={"#st": "state"})
