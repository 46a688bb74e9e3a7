"""Segments: immutable S3 objects holding complete samples' tar members, streamed in flat memory.

A packer appends samples to the open shard by writing one segment (`segments/<random>.tar`) and
its index (`.json` beside it), then committing it in the pack journal (core.pack.journal). A segment
is never rewritten; the sealer composes the shard from segments server-side (core.pack.seal) and
deletes them once the shard is announced. Segments that were written but never committed (a lost
race, a crash before the commit) are garbage for the bucket's lifecycle rules.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from botocore.exceptions import ClientError

from contracts import s3_layout
from contracts.messages import Frozen, Sample
from core import aws
from core.pack import shards


class SampleUnavailable(ValueError):
    """A sample's stored bytes cannot be read as its record describes them."""

    def __init__(self, sample: Sample, reason: str) -> None:
        super().__init__(f"{sample.sha256}: {reason}")
        self.sample = sample


class MemberEntry(Frozen):
    name: str
    offset: int  # of the header block; the data follows 512 bytes later
    size: int
    sha256: str
    header_sha256: str


class SampleEntry(Frozen):
    key: str
    partner: str
    aspect: str
    offset: int
    size: int  # all three members, padding included
    members: tuple[MemberEntry, ...]

    def shifted(self, by: int) -> "SampleEntry":
        return self.model_copy(update={"offset": self.offset + by, "members": tuple(
            m.model_copy(update={"offset": m.offset + by}) for m in self.members)})


class Segment(Frozen):
    """A committed segment as the journal lists it."""

    key: str
    version_id: str = ""
    index_version_id: str = ""
    size: int
    samples: int

    @property
    def index_key(self) -> str:
        return index_key_of(self.key)


@dataclass(frozen=True)
class Written:
    segment: Segment
    samples: tuple[Sample, ...]
    partners: Counter[str] = field(default_factory=Counter)
    aspects: Counter[str] = field(default_factory=Counter)


def index_key_of(segment_key: str) -> str:
    return segment_key.removesuffix(".tar") + ".json"


# --- streaming uploads --------------------------------------------------------------------------

class StreamUpload:
    """Bytes -> one S3 object: one PUT when it stays small, else multipart; one part in memory.

    The part is one preallocated buffer, reused: bytes are copied into it once (a stream's bytes
    are read straight into it) and a full part is sent from it without another copy.
    `checksum` asks S3 to check a CRC32 of every request body (docs/pack.md, "Integrity").
    """

    def __init__(self, bucket: str, key: str, content_type: str, part_bytes: int, checksum: bool = True) -> None:
        self.bucket, self.key, self.content_type, self.checksum = bucket, key, content_type, checksum
        self.buffer = _take_buffer(part_bytes)
        self.view = memoryview(self.buffer)
        self.filled = 0  # bytes of the buffer not yet sent
        self.size = 0
        self.upload_id = ""
        self.parts: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:
        source = memoryview(data)
        while source:
            taken = min(len(source), len(self.buffer) - self.filled)
            self.view[self.filled:self.filled + taken] = source[:taken]
            source = source[taken:]
            self._advance(taken)

    def write_from(self, stream: Any, size: int, observe: Callable[[memoryview], Any] | None = None) -> int:
        """Read `size` bytes from `stream` (`readinto`) straight into the part; returns how many it had.

        `observe` sees each run of bytes read (a hash), without a copy.
        """
        left = size
        while left:
            room = self.view[self.filled:self.filled + min(left, len(self.buffer) - self.filled)]
            count = stream.readinto(room)
            if not count:
                break
            if observe:
                observe(room[:count])
            left -= count
            self._advance(count)
        return size - left

    def _advance(self, count: int) -> None:
        self.filled += count
        self.size += count
        if self.filled == len(self.buffer):
            self._flush(self.buffer)  # the buffer itself: sent without a copy, reused once the call returns

    def _flush(self, body: bytearray | memoryview) -> None:
        if not self.upload_id:
            self.upload_id = aws.create_multipart(self.bucket, self.key, self.content_type, checksum=self.checksum)
        self.parts.append(aws.upload_part(self.bucket, self.key, self.upload_id, len(self.parts) + 1, body,
                                          checksum=self.checksum))
        self.filled = 0

    def close(self) -> str:
        """Finish the object; returns its version id."""
        try:
            if not self.upload_id:  # under one part: a single PUT
                return aws.put_bytes(self.bucket, self.key, bytes(self.view[:self.filled]), self.content_type,
                                     checksum=self.checksum)
            if self.filled:
                self._flush(self.view[:self.filled])  # the last part, sent from the buffer: no copy of it
            return aws.complete_multipart(self.bucket, self.key, self.upload_id, self.parts)
        finally:
            self._release()

    def abort(self) -> None:
        self._release()
        if self.upload_id:
            aws.abort_multipart(self.bucket, self.key, self.upload_id)

    def _release(self) -> None:
        """Hand the part buffer back for the next upload; this one sends nothing more from it."""
        if self.buffer:
            _give_buffer(self.buffer)
            self.buffer = bytearray()
            self.view = memoryview(self.buffer)


# A warm Lambda process packs invocation after invocation: allocating (and zeroing) a fresh 16 MiB
# part for each segment cost 7% of the pack worker's CPU in the load test, whose segments are small.
# One idle buffer per size is kept; only bytes written since it was taken are ever sent.
_IDLE_BUFFERS: dict[int, bytearray] = {}


def _take_buffer(size: int) -> bytearray:
    return _IDLE_BUFFERS.pop(size, None) or bytearray(size)


def _give_buffer(buffer: bytearray) -> None:
    _IDLE_BUFFERS.setdefault(len(buffer), buffer)


# --- writing one segment ------------------------------------------------------------------------

def write_segment(candidates: Iterable[Sample], bucket: str, budget: int, slots: int, take_first: bool,
                  part_bytes: int) -> Written | None:
    """Stream candidates (in order) into a new segment while they fit `budget` bytes and `slots`.

    The first candidate is written even when it alone exceeds the budget if `take_first` (an
    empty shard takes any sample). None when not even the first fits.
    """
    key = s3_layout.segment_key(uuid.uuid4().hex)
    upload = StreamUpload(bucket, key, "application/x-tar", part_bytes, checksum=False)
    written: list[Sample] = []
    entries: list[SampleEntry] = []
    try:
        for sample in candidates:
            if len(written) == slots:
                break
            size, body = _open_image(sample)
            span = shards.sample_span(sample, size)
            if upload.size + span > budget and (written or not take_first):
                body.close()
                break
            entries.append(_write_sample(upload, sample, size, body))
            written.append(sample)
        if not written:
            upload.abort()
            return None
        version_id = upload.close()
    except BaseException:
        upload.abort()
        raise
    return _finish(upload, version_id, entries, written)


def write_segment_of(samples: Iterable[tuple[Sample, bytes]], bucket: str, part_bytes: int) -> Written:
    """A segment of samples whose stored bytes are already in hand (imports: core.import_shard.importer), sorted
    by key as the packer sorts its own; the same members, headers and index as `write_segment`."""
    key = s3_layout.segment_key(uuid.uuid4().hex)
    upload = StreamUpload(bucket, key, "application/x-tar", part_bytes, checksum=False)
    ordered = sorted(samples, key=lambda pair: pair[0].sha256)
    try:
        entries = [_write_sample(upload, sample, len(data), io.BytesIO(data)) for sample, data in ordered]
        version_id = upload.close()
    except BaseException:
        upload.abort()
        raise
    return _finish(upload, version_id, entries, [sample for sample, _ in ordered])


def _finish(upload: StreamUpload, version_id: str, entries: list[SampleEntry], samples: list[Sample]) -> Written:
    """The completed segment's index beside it, and what was written."""
    index = json.dumps({"segment": upload.key, "samples": [e.model_dump() for e in entries]}, separators=(",", ":"))
    index_version_id = aws.put_bytes(upload.bucket, index_key_of(upload.key), index.encode(), "application/json")
    segment = Segment(key=upload.key, version_id=version_id, index_version_id=index_version_id, size=upload.size,
                      samples=len(entries))
    return Written(segment, tuple(samples), Counter(e.partner for e in entries), Counter(e.aspect for e in entries))


def read_index(bucket: str, segment: Segment) -> list[SampleEntry]:
    raw = json.loads(aws.read_object(bucket, segment.index_key))
    return [SampleEntry.model_validate(e) for e in raw["samples"]]


def _open_image(sample: Sample) -> tuple[int, Any]:
    bucket, key = sample.content_location
    pinned = _pinned_version(sample)
    try:
        size, body = aws.open_object(bucket, key, pinned)
    except ClientError as exc:
        if aws.error_code(exc) in {"NoSuchKey", "NoSuchVersion", "404", "InvalidArgument"}:
            raise SampleUnavailable(sample, f"s3://{bucket}/{key} is gone ({aws.error_code(exc)})") from exc
        raise
    if pinned and size != sample.size:
        body.close()
        raise SampleUnavailable(sample, f"version {pinned} has {size} bytes, the record says {sample.size}")
    return size, body


def _pinned_version(sample: Sample) -> str:
    """The upload's version when the shard stores the upload itself: those bytes cannot change."""
    pinned = sample.version_id and sample.content_location == (sample.bucket, sample.key)
    return sample.version_id if pinned else ""


def _write_sample(upload: StreamUpload, sample: Sample, size: int, body: Any) -> SampleEntry:
    """Image, record, caption: headers and bytes into the upload; returns the sample's index entry."""
    start = upload.size
    members = [_write_image(upload, sample, size, body)]
    for name, data in shards.small_members(sample):
        members.append(_write_member(upload, name, data))
    return SampleEntry(key=sample.sha256, partner=sample.partner, aspect=sample.aspect_bucket, offset=start,
                       size=upload.size - start, members=tuple(members))


def _write_image(upload: StreamUpload, sample: Sample, size: int, body: Any) -> MemberEntry:
    header = shards.member_header(shards.image_name(sample), size)
    offset = upload.size
    upload.write(header)
    expected = sample.content_sha256
    digest = None if _pinned_version(sample) else hashlib.sha256()
    with body:
        copied = upload.write_from(body, size, digest.update if digest else None)
    if copied < size:
        raise SampleUnavailable(sample, f"the object ended {size - copied} bytes early")
    if digest and digest.hexdigest() != expected:
        raise SampleUnavailable(sample, f"stored bytes hash to {digest.hexdigest()}, the record says {expected}")
    upload.write(bytes(shards.padding(size)))
    return MemberEntry(name=shards.image_name(sample), offset=offset, size=size, sha256=expected,
                       header_sha256=hashlib.sha256(header).hexdigest())


def _write_member(upload: StreamUpload, name: str, data: bytes) -> MemberEntry:
    header = shards.member_header(name, len(data))
    offset = upload.size
    upload.write(header)
    upload.write(data)
    upload.write(bytes(shards.padding(len(data))))
    return MemberEntry(name=name, offset=offset, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                       header_sha256=hashlib.sha256(header).hexdigest())
