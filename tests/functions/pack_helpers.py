"""What the pack tests share: samples uploaded as ingest leaves them, and a reader of sealed shards (and of their
sample tables, read as the trainer reads them)."""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from atelier.local.provision import Provisioned
from contracts import pipeline_table, s3_layout
from contracts.aspect_buckets import aspect_bucket, bucket_ratio
from contracts.messages import Sample, ShardSealed
from core import aws
from core.pack import shards
from core.pack.settings import PackSettings
from trainer.data.tables import span_members, table_rows

PARTNERS = ("partner-a", "partner-b")
SHAPES = ((96, 96), (128, 96), (96, 128), (160, 90))


def settings_for(stack: Provisioned, **overrides: Any) -> PackSettings:
    """PackFunction's settings from the template, with test-sized shards and parts."""
    values: dict[str, Any] = dict(
        table=stack.outputs["PipelineTableName"], data_bucket=stack.outputs["DataBucketName"], event_bus="default",
        shard_target_bytes=64 << 10, shard_max_samples=1000, shard_max_age_s=3600,
        lanes=1, min_part_bytes=4 << 10, part_bytes=8 << 10, seal_lease_s=0.0)
    values.update(overrides)
    return PackSettings(**values)


def upload_sample(stack: Provisioned, n: int, size: int | None = None, key: str | None = None,
                  rng: random.Random | None = None, pack_lane: int | None = None) -> Sample:
    """An accepted sample: its bytes in the uploads bucket and its record in the table, as ingest leaves them."""
    rng = rng or random.Random(n)
    image = rng.randbytes(size if size is not None else rng.randint(200, 3000))
    bucket = stack.outputs["UploadsBucketName"]
    key = key or f"{PARTNERS[n % 2]}/batch/{n:05d}.jpg"
    version = boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=image).get("VersionId", "")
    width, height = SHAPES[n % len(SHAPES)]
    sha = hashlib.sha256(image).hexdigest()
    sample = Sample(sha256=sha, partner=key.split("/", 1)[0], bucket=bucket, key=key, version_id=version,
                    format="jpeg", width=width, height=height, size=len(image), caption=f"sample {n}",
                    license="CC-BY-4.0", source="tests", uploaded_at="2026-11-29T12:00:00.000Z",
                    aspect_bucket=aspect_bucket(width, height), content_bucket=bucket, content_key=key,
                    content_sha256=sha)
    aws.put_item(stack.outputs["PipelineTableName"], pipeline_table.sample_item(sample, pack_lane=pack_lane))
    return sample


@dataclass(frozen=True)
class Shard:
    key: str
    body: bytes
    members: list[tuple[str, bytes]]

    @property
    def sample_keys(self) -> list[str]:
        return [name.split(".", 1)[0] for name, _ in self.members[::3]]


def sealed_shards(settings: PackSettings) -> dict[str, Shard]:
    """Every tar under shards/, read back with Python's tarfile."""
    s3 = boto3.client("s3")
    listing = s3.list_objects_v2(Bucket=settings.data_bucket, Prefix=s3_layout.SHARDS).get("Contents", [])
    found = {}
    for item in listing:
        body = s3.get_object(Bucket=settings.data_bucket, Key=item["Key"])["Body"].read()
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
        shard_id = item["Key"].removeprefix(s3_layout.SHARDS).removesuffix(".tar")
        found[shard_id] = Shard(item["Key"], body, members)
    return found


def index_of(settings: PackSettings, shard_id: str) -> dict[str, Any]:
    return json.loads(aws.read_object(settings.data_bucket, shards.index_key(shard_id)))


def sealed_record(settings: PackSettings, shard_id: str) -> ShardSealed:
    item = aws.get_item(settings.table, pipeline_table.sealed_pk(shard_id))
    assert item, f"no SEALED# record for {shard_id}"
    return ShardSealed.model_validate_json(item["record"])


def check_shard(settings: PackSettings, shard_id: str, shard: Shard, samples: dict[str, Sample]) -> None:
    """A sealed shard is exactly what its record, its index and its samples say."""
    sealed = sealed_record(settings, shard_id)
    index = index_of(settings, shard_id)
    digest, size = shards.digest_of_tar(io.BytesIO(shard.body))
    assert (sealed.sha256, sealed.size, sealed.samples) == (digest, size, len(shard.members) // 3)
    assert (index["digest"], index["bytes"], index["samples_count"]) == (digest, size, sealed.samples)
    assert [e["key"] for e in index["samples"]] == shard.sample_keys
    for entry in index["samples"]:
        for member in entry["members"]:
            data = shard.body[member["offset"] + shards.BLOCK:member["offset"] + shards.BLOCK + member["size"]]
            assert hashlib.sha256(data).hexdigest() == member["sha256"], member
    # the bytes are the reference rendering of the same samples in the same order
    ordered = [(samples[k], shard.members[3 * i][1]) for i, k in enumerate(shard.sample_keys)]
    assert shards.render_shard(ordered) == shard.body
    assert index["partners"] == dict(sorted(_count(samples[k].partner for k in shard.sample_keys).items()))
    assert sum(index["aspect_buckets"].values()) == sealed.samples
    assert (index["version"], index["table_key"], sealed.table_key) == (2, shards.table_key(shard_id),
                                                                         shards.table_key(shard_id))
    check_table(settings, shard_id, shard, samples)


def check_table(settings: PackSettings, shard_id: str, shard: Shard, samples: dict[str, Sample]) -> None:
    """The shard's sample table, read as the trainer reads it, lists every sample in shard order with its bucket's
    aspect, and each row's range reads back, checked byte by byte, as exactly that sample's members."""
    with tempfile.TemporaryDirectory() as folder:
        tar, table = Path(folder) / f"{shard_id}.tar", Path(folder) / f"{shard_id}.table"
        tar.write_bytes(shard.body)
        table.write_bytes(aws.read_object(settings.data_bucket, shards.table_key(shard_id)))
        rows = table_rows(table, str(tar), shard_id, frozenset())
    assert list(rows.key) == shard.sample_keys
    assert rows.aspect.tolist() == [bucket_ratio(samples[k].aspect_bucket) for k in shard.sample_keys]
    assert rows.encodings == {None}
    for number, (key, offset, size, digest) in enumerate(zip(rows.key, rows.offset, rows.size, rows.digest)):
        members = span_members(shard.body[offset:offset + size], int(offset), str(key), bytes(digest))
        assert members == {name.split(".", 1)[1]: data for name, data in shard.members[3 * number:3 * number + 3]}


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts
