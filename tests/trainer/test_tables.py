"""trainer.data.tables: shards indexed from their sample tables with one read and no header walk, samples read
by offset and checked against their rows; shards without a table still walked; wrong tables never trusted."""

import json
import shutil
import struct

import numpy as np
import pytest

from contracts.shard_index import TableHeader, columns, row_struct, table_of_members
from trainer.data import scan, tables
from trainer.data.loader import make_loader
from trainer.data.shards import ShardIndexError, index_shards
from trainer.data.tables import CorruptSample, RangeFile
from trainer.jobs.latent_writer import write_tar
from tests.trainer.test_data import keys_of, step_batches
from tests.trainer.test_exclusions import step_batches_of


def members_of(samples: list[dict]) -> list[tuple[str, bytes]]:
    """A shard's members as the packer orders them: samples by key; image, record, caption."""
    return [(f"{sample['key']}.{extension}", data) for sample in sorted(samples, key=lambda s: s["key"])
            for extension, data in [(sample["extension"], sample["image"]),
                                    ("json", json.dumps(sample["metadata"]).encode()),
                                    ("txt", sample["caption"].encode())]]


def write_tabled(root, shard_id: str, samples: list[dict]) -> None:
    """`<root>/<shard_id>.tar` in the packer's layout and its table `<root>/indexes/<shard_id>.table`."""
    members = members_of(samples)
    write_tar(root / f"{shard_id}.tar", members)
    aspects = {sample["key"]: sample["metadata"]["width"] / sample["metadata"]["height"] for sample in samples}
    (root / "indexes").mkdir(parents=True, exist_ok=True)
    (root / "indexes" / f"{shard_id}.table").write_bytes(table_of_members(shard_id, members, aspects))


@pytest.fixture
def tabled(tmp_path, samples):
    """Two shards of three samples with their tables, beside a copy of the same shards without."""
    for shard_id, part in (("shard-a", samples[:3]), ("shard-b", samples[3:])):
        write_tabled(tmp_path / "tabled", shard_id, part)
    (tmp_path / "walked").mkdir()
    for path in (tmp_path / "tabled").glob("*.tar"):
        shutil.copy(path, tmp_path / "walked" / path.name)
    return tmp_path / "tabled"


@pytest.fixture
def reads(monkeypatch):
    """Every read of a shard or a table, as (file name, offset, size); walking a tar with wids fails the test."""
    log = []

    class Counted(RangeFile):
        def __init__(self, path):
            super().__init__(path)
            self.name = str(path).rsplit("/", 1)[-1]

        def read(self, offset, size):
            log.append((self.name, offset, size))
            return super().read(offset, size)

    def no_walk(*args, **kwargs):
        raise AssertionError("a tar's headers were walked")

    monkeypatch.setattr(tables, "open_file", Counted)
    monkeypatch.setattr(scan, "IndexedTarSamples", no_walk)
    return log


def test_a_shard_with_a_table_is_indexed_from_one_read_of_it_and_nothing_of_the_tar(tabled, reads, samples):
    index = index_shards(tabled)
    assert reads == [(f"{shard}.table", 0, (tabled / "indexes" / f"{shard}.table").stat().st_size)
                           for shard in ("shard-a", "shard-b")]
    assert sorted(index.key) == sorted(sample["key"] for sample in samples)
    assert (index.scanned, index.problems, index.latent) == (0, [], False)


def test_the_table_gives_the_index_and_the_batches_the_walk_gives(tabled, monkeypatch):
    walked_index = index_shards(tabled.parent / "walked")
    walked = keys_of(step_batches(tabled.parent / "walked", steps=9))
    index = index_shards(tabled)
    assert (index.key.tolist(), index.aspect.tolist()) == (walked_index.key.tolist(), walked_index.aspect.tolist())
    assert (index.offset.tolist(), index.size.tolist()) == (walked_index.offset.tolist(), walked_index.size.tolist())
    assert keys_of(step_batches(tabled, steps=9)) == walked


def test_a_sample_is_one_read_of_its_range(tabled, reads):
    dataset = step_batches(tabled, batch_size=2)
    reads.clear()
    batch = dataset.batch(1, 0)
    rows = [int(np.flatnonzero(dataset.index.key == key)[0]) for key in batch["key"]]
    assert reads == [(batch["shard"][n], int(dataset.index.offset[row]), int(dataset.index.size[row]))
                     for n, row in enumerate(rows)]


def test_a_shard_without_a_table_is_walked_beside_one_with(tabled, samples):
    (tabled / "indexes" / "shard-b.table").unlink()
    index = index_shards(tabled)
    assert (index.scanned, sorted(index.key)) == (1, sorted(sample["key"] for sample in samples))
    assert len(keys_of(step_batches(tabled))) == 6


def test_tables_come_from_the_index_dir_when_one_is_given(tabled, tmp_path, reads):
    (tabled / "indexes").rename(tmp_path / "channel-indexes")
    assert index_shards(tabled, index_dir=tmp_path / "channel-indexes").scanned == 0
    assert reads and all(name.endswith(".table") for name, _, _ in reads)


def test_excluded_samples_of_a_tabled_shard_are_never_read(tabled, reads, samples):
    # GIVEN an exclusion list naming one sample of shard-a, and where that sample lies in the shard
    excluded = sorted(samples[:3], key=lambda s: s["key"])[1]["key"]
    full = index_shards(tabled)
    row = int(np.flatnonzero(full.key == excluded)[0])
    start, end = int(full.offset[row]), int(full.offset[row] + full.size[row])
    # WHEN the shards are indexed with the list and batches are drawn for two epochs
    index = index_shards(tabled, exclude={"shard-a": {excluded}})
    reads.clear()
    drawn = {key for batch in make_loader(step_batches_of(index), 0) for key in batch["key"]}
    # THEN it is neither indexed nor drawn, every other sample is, and no read of shard-a touched its range
    assert (index.excluded, excluded in set(index.key)) == (1, False)
    assert drawn == {sample["key"] for sample in samples} - {excluded}
    assert [name for name, _, _ in reads if name == "shard-a.tar"]
    assert not [(offset, size) for name, offset, size in reads
                if name == "shard-a.tar" and offset < end and offset + size > start]


def test_the_table_of_another_shard_stops_the_job(tabled):
    shutil.copy(tabled / "indexes" / "shard-a.table", tabled / "indexes" / "shard-b.table")
    with pytest.raises(ShardIndexError, match="shard-b.table does not describe .*shard-b.tar: it is the table of shard-a"):
        index_shards(tabled)


def test_a_table_of_a_shard_of_another_size_stops_the_job(tabled):
    with open(tabled / "shard-a.tar", "ab") as tar:
        tar.write(bytes(10240))
    with pytest.raises(ShardIndexError, match="this one has"):
        index_shards(tabled)


@pytest.mark.parametrize("damage", ["cut", "header"])
def test_an_unreadable_table_stops_the_job_and_says_what_to_do(tabled, damage):
    path = tabled / "indexes" / "shard-a.table"
    data = path.read_bytes()
    path.write_bytes(data[:-7] if damage == "cut" else b'{"format": "something else"}\n' + data.split(b"\n", 1)[1])
    with pytest.raises(ShardIndexError, match="not a readable sample table .*remove it to index the shard by walking"):
        index_shards(tabled)


def test_rows_outside_the_shard_stop_the_job(tabled):
    path = tabled / "indexes" / "shard-a.table"
    head, body = path.read_bytes().split(b"\n", 1)
    rows = np.frombuffer(body, dtype=np.dtype([(n, t) for n, t, _ in columns(64)])).copy()
    rows["offset"][-1] += 1 << 20
    path.write_bytes(head + b"\n" + rows.tobytes())
    with pytest.raises(ShardIndexError, match="not ranges of whole blocks, in order, inside the shard"):
        index_shards(tabled)


def test_a_sample_whose_bytes_differ_from_its_row_is_reported_and_replaced(tabled, samples):
    # GIVEN one caption changed in the tar after its table was written (same size: the structure still agrees)
    victim = sorted(samples[:3], key=lambda s: s["key"])[0]
    data = (tabled / "shard-a.tar").read_bytes()
    at = data.index(victim["caption"].encode())
    (tabled / "shard-a.tar").write_bytes(data[:at] + b"A" + data[at + 1:])
    # WHEN batches are drawn
    batches = list(make_loader(step_batches(tabled, steps=9), 0))
    # THEN it never reaches a batch and each draw of it is reported
    assert all(victim["key"] not in batch["key"] for batch in batches)
    reports = [report for batch in batches for report in batch["corrupt"]]
    assert reports and set(reports) == {f"shard-a.tar/{victim['key']}: CorruptSample: {victim['key']}: its bytes "
                                        "differ from the shard's sample table"}


def test_a_row_that_points_at_another_sample_stops_the_job(tabled):
    # GIVEN a table whose first two rows have swapped keys (each range is still a whole sample inside the shard)
    path = tabled / "indexes" / "shard-a.table"
    head, body = path.read_bytes().split(b"\n", 1)
    rows = np.frombuffer(body, dtype=np.dtype([(n, t) for n, t, _ in columns(64)])).copy()
    rows["key"][[0, 1]] = rows["key"][[1, 0]]
    path.write_bytes(head + b"\n" + rows.tobytes())
    dataset = step_batches(tabled, steps=9)
    # WHEN the swapped samples are read THEN the job stops: no replacement is drawn for a table that lies
    with pytest.raises(ShardIndexError, match="the sample table disagrees with the shard: .* of another sample"):
        list(make_loader(dataset, 0))


def test_a_digest_ending_in_zero_bytes_is_kept_whole(tmp_path):
    # numpy's S32 would strip the trailing NULs of a digest: the column is raw bytes
    digest = bytes(range(1, 29)) + bytes(4)
    packer = row_struct(1)
    header = TableHeader("s", 10240, 1, 1).line()
    (tmp_path / "s.tar").write_bytes(bytes(10240))
    (tmp_path / "s.table").write_bytes(header + packer.pack(b"k", 0, 512, 1.0, digest))
    rows = tables.table_rows(tmp_path / "s.table", str(tmp_path / "s.tar"), "s", frozenset())
    assert bytes(rows.digest[0]) == digest
    assert struct.calcsize("<1sQQd32s") == packer.size == np.dtype([(n, t) for n, t, _ in columns(1)]).itemsize
