"""What a training process reads before its first batch, over a simulated lazily-fetched (FastFile) shard.

Over SageMaker FastFile every read of a shard is an S3 range request. Here a shard is a virtual file
(`VirtualShard`): a tar of N samples in the packer's layout (a 250 KB image member, its JSON record,
its caption), whose headers, records, captions and image heads are made on demand at their offsets,
zeros elsewhere, so a 25 GB shard costs no disk. Only its size sits in the channel, as a sparse file.
Its sample table is real (`indexes/<shard>.table`), made with the calls core.pack.seal makes per entry.
Every read goes through a counter (`Counter`): one range request per read, its bytes, and a fixed
latency per range (--latency-ms, not slept: added to the measured wall time).

Two paths, for a 1 GB and a 25 GB shard of the same samples (4,000 and 100,000 of them):
- table: what the trainer does now. trainer.data.shards.index_shards (one read of the table), the
  BatchPlan, and the first micro-batch through trainer.data.loader.StepBatches (one read per sample,
  JPEG decode, crop to the bucket), all measured as they run, reads counted at trainer.data.tables.open_file.
- walk: what the trainer did before, replayed: wids walks every member header (one read of 512 bytes
  each, parsed with wids' own parse_tar_header), then one read of each sample's JSON record; the same
  plan and first batch, read member by member as wids read them (three reads a sample). wids maps
  the file (its reads are page faults, which no wrapper sees), so its reads are replayed, not counted live.

Prints one JSON line per figure: train.startup_read_share_{1gb,25gb} (bytes read before the first
batch / the shard's bytes), train.first_batch_s_{1gb,25gb} (wall + ranges x latency; with
`index_and_plan_s`, the wall of the part that grows with the shard) and
train.first_batch_s_ratio_25gb_vs_1gb (of the medians; the median of the rounds' own ratios beside
it); each with the walk's figure beside it. The table path runs
--rounds times, 1 GB and 25 GB alternating (A B A B), after a warm-up; the walk once per size.

    .venv/bin/python bench/startup_read.py [--latency-ms 20] [--rounds 9] [--batch 32] [--resolution 256]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from wids.wids_mmtar import next_header, parse_tar_header  # noqa: E402

from bench.stamp import commit, versions  # noqa: E402
from contracts import shard_index  # noqa: E402
from contracts.aspect_buckets import ASPECT_BUCKETS, bucket_ratio  # noqa: E402
from contracts.shard_members import member_header  # noqa: E402
from trainer.data import tables  # noqa: E402
from trainer.data.loader import StepBatches  # noqa: E402
from trainer.data.plan import BatchPlan  # noqa: E402
from trainer.data.scan import aspect_from_metadata  # noqa: E402
from trainer.data.shards import ShardIndex, index_shards  # noqa: E402
from trainer.data.phases import RunPlan  # noqa: E402

BLOCK = 512
IMAGE_BYTES = 250_000  # the seeds' shards: 25 GB of about 10^5 samples
RECORD_BYTES = 256  # records padded with spaces to one length (JSON allows it), so every sample spans the same bytes
CAPTION_BYTES = 64
BUCKETS = ("1:1", "4:3", "3:4", "16:9", "9:16", "3:2")
SIZES = {"1gb": 4_000, "25gb": 100_000}  # samples: 1.0 GB and 25.4 GB shards


class VirtualShard:
    """A packer-layout tar of `samples` samples whose bytes are made on demand; zeros between what is made."""

    members = (("jpg", IMAGE_BYTES), ("json", RECORD_BYTES), ("txt", CAPTION_BYTES))

    def __init__(self, samples: int, jpeg: bytes):
        self.samples, self.jpeg = samples, jpeg
        self.offsets = []  # of each member's header within a sample
        at = 0
        for _, size in self.members:
            self.offsets.append(at)
            at += BLOCK + shard_index.padded(size)
        self.span = at
        payload = samples * self.span
        self.size = payload + 2 * BLOCK + (-(payload + 2 * BLOCK) % (20 * BLOCK))
        self.templates = [member_header("0" * 64 + "." + extension, size) for extension, size in self.members]
        self.lengths = [len(jpeg), RECORD_BYTES, CAPTION_BYTES]  # of what `data` makes; zeros follow to the member's size

    @staticmethod
    def key(number: int) -> str:
        return hashlib.sha256(str(number).encode()).hexdigest()

    def header(self, number: int, member: int) -> bytes:
        """contracts.shard_members' header of a member, from a template: only the key and the checksum differ."""
        template, key = self.templates[member], self.key(number).encode()
        checksum = sum(template) - sum(template[148:156]) + 8 * 32 - sum(b"0" * 64) + sum(key)
        return key + template[64:148] + b"%06o\0 " % checksum + template[156:]

    def data(self, number: int, member: int) -> bytes:
        if member == 0:
            return self.jpeg  # then zeros to the member's size
        if member == 1:
            record = {"partner": "partner-a", "license": "cc-by-4.0", "aspect_bucket": BUCKETS[number % len(BUCKETS)],
                      "sha256": self.key(number)}
            return json.dumps(record).encode().ljust(RECORD_BYTES)
        return f"a synthetic sample number {number}".encode().ljust(CAPTION_BYTES)

    def read(self, offset: int, size: int) -> bytes:
        out = bytearray(max(0, min(size, self.size - offset)))
        end = offset + len(out)
        first, last = offset // self.span, min(self.samples - 1, (end - 1) // self.span)
        for number in range(first, last + 1):
            for member, start in enumerate(self.offsets):
                at = number * self.span + start
                for piece_start, length, make in ((at, BLOCK, self.header), (at + BLOCK, self.lengths[member], self.data)):
                    lo, hi = max(offset, piece_start), min(end, piece_start + length)
                    if lo < hi:  # made only where the read overlaps it
                        out[lo - offset:hi - offset] = make(number, member)[lo - piece_start:hi - piece_start]
        return bytes(out)

    def table(self, shard_id: str) -> bytes:
        """Its sample table, row by row as core.pack.seal writes it (contracts.shard_index)."""
        image_sha = hashlib.sha256(self.jpeg + bytes(IMAGE_BYTES - len(self.jpeg))).hexdigest()
        packer = shard_index.row_struct(64)
        rows = [shard_index.TableHeader(shard_id, self.size, self.samples, 64).line()]
        for number in range(self.samples):
            lines = []
            for member, (start, (_, size)) in enumerate(zip(self.offsets, self.members)):
                data_sha = image_sha if member == 0 else hashlib.sha256(self.data(number, member)).hexdigest()
                lines.append(shard_index.member_line(number * self.span + start,
                                                     hashlib.sha256(self.header(number, member)).hexdigest(), size,
                                                     data_sha))
            rows.append(shard_index.row(packer, self.key(number), number * self.span, self.span,
                                        bucket_ratio(BUCKETS[number % len(BUCKETS)]), shard_index.sample_digest(lines)))
        return b"".join(rows)


class Counter:
    """Range requests and bytes of every read through it."""

    def __init__(self) -> None:
        self.ranges, self.bytes = 0, 0

    def count(self, size: int) -> None:
        self.ranges += 1
        self.bytes += size


class CountedFile:
    """trainer.data.tables.RangeFile's interface over a virtual shard or a real table, each read counted."""

    def __init__(self, source, counter: Counter):
        self.source, self.counter = source, counter

    def read(self, offset: int, size: int) -> bytes:
        data = self.source.read(offset, size)
        self.counter.count(len(data))
        return data

    def close(self) -> None:
        if isinstance(self.source, tables.RangeFile):
            self.source.close()

    def __enter__(self) -> "CountedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def count_reads(virtual: dict[str, VirtualShard], counter: Counter) -> None:
    """From now on the trainer opens shards and tables through the counter (a shard in `virtual` is made up)."""
    tables.open_file = lambda path: CountedFile(virtual.get(str(path)) or tables.RangeFile(path), counter)


def plan_of(index: ShardIndex, args: argparse.Namespace) -> BatchPlan:
    plan = RunPlan([{"resolution": args.resolution, "batch_size": args.batch, "learning_rate": 1e-4, "steps": 1}])
    batch_plan = BatchPlan(index.aspect, plan, 0, 0, 1, 8, True)
    batch_plan.slot(1, 0)  # buckets and the epoch's batches, as the first batch needs them
    return batch_plan


def first_batch(index: ShardIndex, batch_plan: BatchPlan) -> dict:
    return StepBatches(index, batch_plan, 1, 1, 0.0, False).batch(1, 0)


def table_path(channel: Path, counter: Counter, args: argparse.Namespace) -> tuple[float, int, int, float]:
    """(seconds, ranges, bytes) from nothing to the first batch, reading the table, and the wall seconds
    of its part that grows with the shard (the index and the plan: everything but reading the batch)."""
    before = (counter.ranges, counter.bytes)
    started = time.perf_counter()
    index = index_shards(channel)
    batch_plan = plan_of(index, args)
    indexed = time.perf_counter() - started
    batch = first_batch(index, batch_plan)
    wall = time.perf_counter() - started
    assert not batch["corrupt"] and len(batch["key"]) == args.batch, batch["corrupt"][:3]
    ranges, read = counter.ranges - before[0], counter.bytes - before[1]
    return wall + ranges * args.latency_ms / 1e3, ranges, read, indexed


def walk_path(virtual: dict[str, VirtualShard], path: str, args: argparse.Namespace) -> tuple[float, int, int]:
    """The same, as wids' walk and the record reads did it, replayed over the counter."""
    counter, shard, started = Counter(), virtual[path], time.perf_counter()
    count_reads(virtual, counter)
    source = CountedFile(shard, counter)
    offset, members = 0, []
    while 0 <= offset < shard.size:  # wids' MMIndexedTar._build_index: every header, one after the other
        header = parse_tar_header(source.read(offset, BLOCK)[:500])
        name = header.name.decode("utf-8").strip("\x00")
        if name:
            members.append((name, offset, int(header.size.decode("utf-8")[:-1], 8)))
        offset = next_header(offset, header)
    rows = []
    for first in range(0, len(members), 3):  # then each sample's JSON record, its second member
        (name, start, _), (_, record_at, record_size) = members[first], members[first + 1]
        rows.append((name.split(".")[0], aspect_from_metadata(source.read(record_at + BLOCK, record_size)), start))
    keys, aspects, starts = zip(*rows)
    index = ShardIndex([path], np.zeros(len(rows), dtype=np.int32), np.array(keys), np.array(aspects, dtype=np.float64),
                       np.array(starts, dtype=np.int64), np.full(len(rows), shard.span, dtype=np.int64),
                       np.zeros(len(rows), dtype="V32"))
    reads_before = counter.ranges
    first_batch(index, plan_of(index, args))  # read here one range a sample; wids read it member by member
    counter.ranges += 2 * (counter.ranges - reads_before)
    wall = time.perf_counter() - started
    return wall + counter.ranges * args.latency_ms / 1e3, counter.ranges, counter.bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added per range request")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=256)
    args = parser.parse_args(argv)
    image = Image.fromarray((np.random.default_rng(0).random((240, 320, 3)) * 255).astype("uint8"))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    jpeg = buffer.getvalue()
    counter, virtual = Counter(), {}
    with tempfile.TemporaryDirectory() as root:
        channels = {}
        for label, samples in SIZES.items():
            shard, shard_id = VirtualShard(samples, jpeg), f"shard-{label}"
            assert shard.header(7, 1) == member_header(f"{shard.key(7)}.json", RECORD_BYTES)
            channel = Path(root) / label
            (channel / "indexes").mkdir(parents=True)
            with open(channel / f"{shard_id}.tar", "wb") as placeholder:  # sparse: its size, no blocks
                placeholder.truncate(shard.size)
            (channel / "indexes" / f"{shard_id}.table").write_bytes(shard.table(shard_id))
            virtual[str(channel / f"{shard_id}.tar")], channels[label] = shard, channel
            print(json.dumps({"event": "made", "shard": label, "bytes": shard.size, "samples": samples}), flush=True)
        count_reads(virtual, counter)
        runs: dict[str, list[tuple[float, int, int, float]]] = {label: [] for label in SIZES}
        for label in SIZES:  # warm-up
            table_path(channels[label], counter, args)
        for _ in range(args.rounds):
            for label in SIZES:
                runs[label].append(table_path(channels[label], counter, args))
                print(json.dumps({"event": "table", "shard": label, "s": round(runs[label][-1][0], 3)}), flush=True)
        walked = {}
        for label in SIZES:
            walked[label] = walk_path(virtual, str(channels[label] / f"shard-{label}.tar"), args)
            print(json.dumps({"event": "walk", "shard": label, "s": round(walked[label][0], 1)}), flush=True)
    common = {"commit": commit(), "machine": {"nproc": os.cpu_count(), "gpu": None}, "versions": versions(),
              "config": {"latency_ms_per_range": args.latency_ms, "batch": args.batch, "resolution": args.resolution,
                         "rounds": args.rounds, "order": "1 GB, 25 GB alternating, one process, after a warm-up",
                         "sample": f"{IMAGE_BYTES} B JPEG member (a {len(jpeg)} B 320x240 JPEG, zeros after), "
                                   f"{RECORD_BYTES} B record, {CAPTION_BYTES} B caption",
                         "time": "measured wall + ranges x latency (not slept)"}}
    seconds = {label: statistics.median(run[0] for run in runs[label]) for label in SIZES}
    for label, samples in SIZES.items():
        shard_bytes = VirtualShard(samples, jpeg).size
        _, ranges, read, _ = runs[label][-1]
        walk_s, walk_ranges, walk_read = walked[label]
        emit({**common, "metric": f"train.startup_read_share_{label}", "value": round(read / shard_bytes, 6),
              "unit": "share", "bytes_read": read, "ranges": ranges, "shard_bytes": shard_bytes, "samples": samples,
              "walk": {"value": round(walk_read / shard_bytes, 6), "bytes_read": walk_read, "ranges": walk_ranges}})
        emit({**common, "metric": f"train.first_batch_s_{label}", "value": round(seconds[label], 3), "unit": "s",
              "ranges": ranges, "runs": [round(run[0], 3) for run in runs[label]],
              "index_and_plan_s": round(statistics.median(run[3] for run in runs[label]), 3),
              "walk": {"value": round(walk_s, 1), "ranges": walk_ranges}})
    paired = statistics.median(big[0] / small[0] for small, big in zip(runs["1gb"], runs["25gb"]))
    emit({**common, "metric": "train.first_batch_s_ratio_25gb_vs_1gb", "value": round(seconds["25gb"] / seconds["1gb"], 3),
          "unit": "x", "median_of_round_ratios": round(paired, 3),
          "walk": {"value": round(walked["25gb"][0] / walked["1gb"][0], 2)}})


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
