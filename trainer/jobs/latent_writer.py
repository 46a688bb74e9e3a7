"""Latent shards written by a thread of the encode job's own (trainer/jobs/encode.py), each under a
temporary name and renamed when whole, after its sample table (contracts.shard_index), so that a latent
shard on disk always has its table beside it: `<index dir>/<shard id>.table`.
"""

import contextlib
import io
import os
import queue
import tarfile
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from contracts import shard_members
from contracts.s3_layout import INDEX_TABLE
from contracts.shard_index import sample_key, table_of_members
from trainer.data.latents import sample_members
from trainer.data.shards import shard_id_of


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar as the packer writes one (ustar, contracts.shard_members' fixed headers), under a
    temporary name, then renamed; a failed write leaves nothing behind. A name ustar cannot hold (over
    100 bytes with no `/` to split it at) raises ValueError: pipeline keys are sha256s, far shorter."""
    with _written(path) as partial:
        with tarfile.open(partial, "w", format=shard_members.TAR_FORMAT) as tar:
            for name, data in members:
                tar.addfile(shard_members.tarinfo(name, len(data)), io.BytesIO(data))


def write_table(path: Path, table: bytes) -> None:
    """A sample table, under a temporary name, then renamed."""
    with _written(path) as partial:
        partial.write_bytes(table)


@contextlib.contextmanager
def _written(path: Path) -> Iterator[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".tmp-{path.name}")  # a dot name: core.start_training.encode_job and the trainer skip it
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class ShardWriter:
    """Latent shards written on a thread of their own, so that the main thread only feeds the GPU.

    The main thread hands over each encoded group, then says when a shard is whole; this thread turns
    the samples into members (safetensors, ids, record) and writes the tar. One thread, since that work
    only has to keep up with the GPU, and a shard is written in one place, in order. At most `depth`
    jobs wait, each holding one batch's latents on the host: memory stays that plus the shard being
    gathered, and a slow disk slows the main thread down rather than filling memory. The first error
    here is raised again in the main thread (by its next call, or when it leaves the `with` block),
    and every job after it is dropped.
    """

    def __init__(self, outputs: Mapping[int, Path], identity: str, resolution: int, index_dir: Path, depth: int = 8,
                 head: Sequence[tuple[str, bytes]] = ()):
        self.outputs, self.identity, self.resolution, self.index_dir = outputs, identity, resolution, index_dir
        self.head = list(head)  # what every shard opens with: a family's empty caption (trainer/data/latents.py)
        self.pending: dict[int, dict[int, tuple]] = defaultdict(dict)  # shard -> row -> (its members, aspect), until whole
        self.jobs: queue.Queue[tuple[Callable, tuple] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="latent-shard-writer")
        self.thread.start()

    def add(self, shard: int, keys: list[str], group: dict, latents: torch.Tensor,
            copied: torch.cuda.Event | None, text: dict[str, torch.Tensor] | None = None) -> None:
        """A group's samples (`keys`, its `rows`, `time_ids`, `ids`, `records`, `bucket`); `latents`, one
        per sample, and a family's `text` embeddings by name, one row per sample, may be read once `copied`
        (if any) has completed."""
        self._submit(self._add, shard, keys, group["rows"], latents, copied, group["time_ids"], group["ids"],
                     group["records"], group["bucket"], text)

    def finish(self, shard: int) -> None:
        """The shard is whole: written with its samples in the image shard's order."""
        self._submit(self._finish, shard)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.stopping = error is not None  # the job failed in the main thread: what is still queued is dropped
        self.jobs.put(None)
        self.thread.join()
        if error is None:
            self._raise_if_failed()
        elif self.error is not None and self.error is not error:  # both failed: the writer's error is kept too
            error.add_note(f"the latent shard writer failed too: {self.error!r}")

    def _submit(self, job: Callable, *args) -> None:
        self._raise_if_failed()
        self.jobs.put((job, args))  # blocks while `depth` jobs wait

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:  # after an error, still taken off so that put never blocks
            if self.error is None and not self.stopping:
                try:
                    job[0](*job[1])
                except BaseException as error:  # noqa: BLE001 - raised again in the main thread
                    self.error = error

    def _add(self, shard: int, keys: list[str], rows: list[int], latents: torch.Tensor, copied: torch.cuda.Event | None,
             time_ids: list, ids: torch.Tensor | None, records: list, bucket: tuple[int, int], text: dict | None) -> None:
        if copied is not None:
            copied.synchronize()
        for number, (key, row) in enumerate(zip(keys, rows)):
            self.pending[shard][row] = (sample_members(
                key, latents[number], time_ids[number], None if ids is None else ids[number], records[number],
                self.identity, self.resolution, bucket, None if text is None else {name: tensor[number] for name, tensor
                                                                                   in text.items()}),
                bucket[0] / bucket[1])

    def _finish(self, shard: int) -> None:
        samples = self.pending.pop(shard, {})
        if not samples:  # a shard of nothing but corrupt samples gets no latent shard
            return
        members = self.head + [member for row in sorted(samples) for member in samples[row][0]]
        aspects = {sample_key(written[0][0]): aspect for written, aspect in samples.values()}
        aspects.update({sample_key(name): 1.0 for name, _ in self.head})  # no sample, but a table row holds an aspect
        shard_id = shard_id_of(str(self.outputs[shard]))
        table = self.index_dir / f"{shard_id}{INDEX_TABLE}"
        write_table(table, table_of_members(shard_id, members, aspects, (self.identity, self.resolution)))
        try:
            write_tar(self.outputs[shard], members)
        except BaseException:
            table.unlink(missing_ok=True)  # nothing of a shard that failed stays behind
            raise
