"""core.pack.shards: the WebDataset shard layout of docs/architecture.md."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from contracts.aspect_buckets import aspect_bucket
from contracts.messages import Sample
from core.pack.shards import build_shard, shard_id_for, shard_key


def sample(image: bytes, fmt: str, caption: str) -> tuple[Sample, bytes]:
    sha, key = hashlib.sha256(image).hexdigest(), f"partner-a/{caption}.{fmt}"
    record = Sample(sha256=sha, partner="partner-a", bucket="atelier-uploads", key=key, format=fmt, width=8, height=6,
                    size=len(image), caption=caption, license="CC-BY-4.0", uploaded_at="2026-11-29T12:00:00Z",
                    aspect_bucket=aspect_bucket(8, 6), content_bucket="atelier-uploads", content_key=key,
                    content_sha256=sha)
    return record, image


SAMPLES = [
    sample(b"jpeg bytes", "jpeg", "a red circle"),
    sample(b"png bytes", "png", "ölgemälde im hafen"),
    sample(b"webp bytes", "webp", "a blue square"),
]
BY_SHA = sorted(SAMPLES, key=lambda pair: pair[0].sha256)


def expected_members() -> list[tuple[str, bytes]]:
    """Per sample, sorted by sha256: the image, the record, the caption."""
    members = []
    for record, image in BY_SHA:
        members += [(f"{record.sha256}.{record.extension}", image),
                    (f"{record.sha256}.json", record.model_dump_json().encode()),
                    (f"{record.sha256}.txt", record.caption.encode("utf-8"))]
    return members


def read_members(shard: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        return [(info, tar.extractfile(info).read()) for info in tar.getmembers()]  # type: ignore[union-attr]


# --- bytes --------------------------------------------------------------------------------------

def test_same_samples_in_any_order_give_identical_bytes() -> None:
    shards = {build_shard(list(order)) for order in itertools.permutations(SAMPLES)}

    assert len(shards) == 1


def test_same_samples_in_any_order_give_the_same_sha256() -> None:
    digests = {hashlib.sha256(build_shard(list(order))).hexdigest() for order in itertools.permutations(SAMPLES)}

    assert len(digests) == 1


def test_different_samples_give_different_bytes() -> None:
    assert build_shard(SAMPLES) != build_shard(SAMPLES[:2])


def test_members_are_sorted_by_sample_and_contiguous_per_sample() -> None:
    members = read_members(build_shard(reversed(SAMPLES)))

    assert [(info.name, data) for info, data in members] == expected_members()


def test_members_have_fixed_metadata() -> None:
    members = read_members(build_shard(SAMPLES))

    assert {(info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode, info.type) for info, _ in members} \
        == {(0, 0, 0, "", "", 0o644, tarfile.REGTYPE)}


def test_json_member_is_the_metadata_record() -> None:
    record, _ = SAMPLES[1]
    members = dict((info.name, data) for info, data in read_members(build_shard(SAMPLES)))

    assert Sample.model_validate(json.loads(members[f"{record.sha256}.json"])) == record


def test_empty_input_gives_an_empty_tar() -> None:
    assert read_members(build_shard([])) == []


# --- readers ------------------------------------------------------------------------------------

def test_webdataset_reads_every_sample_back(tmp_path: Path) -> None:
    # GIVEN a shard written to a file
    path = tmp_path / "shard.tar"
    path.write_bytes(build_shard(SAMPLES))

    # WHEN webdataset reads it
    read = [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
            for s in wds.WebDataset(str(path), shardshuffle=False)]

    # THEN each sample comes back under its key with the exact bytes
    assert read == [{"__key__": record.sha256, record.extension: image,
                     "json": record.model_dump_json().encode(), "txt": record.caption.encode("utf-8")}
                    for record, image in BY_SHA]


def test_gnu_tar_lists_the_members(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(build_shard(SAMPLES))

    listing = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True)

    assert listing.stdout.splitlines() == [name for name, _ in expected_members()]


def test_gnu_tar_extracts_the_exact_bytes(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(build_shard(SAMPLES))
    out = tmp_path / "out"
    out.mkdir()

    subprocess.run(["tar", "-xf", str(path), "-C", str(out)], capture_output=True, check=True)

    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == sorted(expected_members())


# --- ids ----------------------------------------------------------------------------------------

def test_shard_id_is_independent_of_order() -> None:
    keys = [record.sha256 for record, _ in SAMPLES]

    assert shard_id_for(keys) == shard_id_for(reversed(keys)) == shard_id_for(sorted(keys))


def test_shard_id_changes_when_a_sample_changes() -> None:
    keys = [record.sha256 for record, _ in SAMPLES]
    other = sample(b"other bytes", "png", "another")[0].sha256

    assert shard_id_for(keys) != shard_id_for(keys[:2] + [other])


def test_shard_id_changes_when_a_sample_is_added() -> None:
    keys = [record.sha256 for record, _ in SAMPLES]

    assert shard_id_for(keys[:2]) != shard_id_for(keys)


def test_shard_id_is_shard_and_32_hex_of_the_sorted_keys() -> None:
    keys = ["b" * 64, "a" * 64]

    assert shard_id_for(keys) == "shard-" + hashlib.sha256(("a" * 64 + "\n" + "b" * 64).encode()).hexdigest()[:32]


@pytest.mark.parametrize(("shard_id", "key"), [("shard-0123", "shards/shard-0123.tar")])
def test_shard_key_is_under_shards(shard_id: str, key: str) -> None:
    assert shard_key(shard_id) == key


# --- streaming layout: names, segments, trailer, digest -----------------------------------------

@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs/path", "a.b.c", "ctrl\x00\x1b[31m\n", "", "ö" * 200])
def test_member_names_are_sanitised(key: str) -> None:
    from core.pack.shards import member_name

    name = member_name(key, "J.P/G\n")

    stem, extension = name.split(".")
    assert stem and all(c.isascii() and (c.isalnum() or c in "_-") for c in stem) and len(stem) <= 90
    assert extension == "jpg" and ".." not in name and not name.startswith("/")


def test_segments_followed_by_the_trailer_are_the_bytes_tarfile_writes() -> None:
    from core.pack.shards import image_name, member_header, padding, render_shard, small_members, trailer

    def segment(pairs: list[tuple[Sample, bytes]]) -> bytes:
        out = b""
        for record, image in pairs:
            for name, data in [(image_name(record), image), *small_members(record)]:
                out += member_header(name, len(data)) + data + bytes(padding(len(data)))
        return out

    first, second = segment(BY_SHA[:2]), segment(BY_SHA[2:])

    assert first + second + trailer(len(first) + len(second)) == render_shard(BY_SHA)


def test_the_tree_digest_pins_every_byte() -> None:
    from core.pack.shards import CorruptShard, digest_of_tar

    body = build_shard(SAMPLES)
    digest, size = digest_of_tar(io.BytesIO(body))
    changed = bytearray(body)
    changed[512] ^= 1  # the first data byte of the first member

    assert size == len(body) and len(digest) == 64
    assert digest_of_tar(io.BytesIO(bytes(changed)))[0] != digest
    for offset in (600, len(body) - 1):  # padding and trailer must be zeros
        with pytest.raises(CorruptShard):
            digest_of_tar(io.BytesIO(body[:offset] + b"\x01" + body[offset + 1:]))
