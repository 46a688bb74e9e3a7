"""Checkpoints written in a thread while training goes on.

Why: writing a checkpoint (safetensors, the optimizer state, an fsync and a sha256 of every file for
the manifest) took 3.6 s for the small preset on an H200, against 0.1-0.3 s to copy its state to the
host, and a run checkpoints every few hundred steps (bench/RESULTS.md, time to target).

How: the step's state is copied to the CPU first (`take_snapshot`, on every rank, since the full
state dicts and the RNG gather are collectives); a thread then writes that copy (`write_snapshot`,
no collective). At most one write is in flight: the next checkpoint waits for the one before, so at
most one copy of the state is held, as when writing in place. A write that fails fails the job at
the next step (`check`), never silently; the job waits for the last write before it ends (`close`).
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

from trainer.runtime.checkpoints import CheckpointError, Snapshot, write_snapshot
from trainer.runtime.distributed import Processes


class CheckpointWriter:
    """Writes snapshots one at a time, in a thread (`background`) or at once."""

    def __init__(self, checkpoint_dir: Path, processes: Processes, keep: int, background: bool = True):
        self.checkpoint_dir, self.processes, self.keep, self.background = checkpoint_dir, processes, keep, background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self._written: deque[tuple[int, Path]] = deque()  # (step, directory) published and not yet reported

    def save(self, snapshot: Snapshot) -> None:
        """Write `snapshot`, after the write before it is done."""
        self.wait()
        self._step = snapshot.step
        if not self.background:
            self._written.append((snapshot.step, write_snapshot(self.checkpoint_dir, self.processes, snapshot, self.keep)))
            return
        # not a daemon: a job that fails meanwhile still finishes the write before the interpreter exits
        self._thread = threading.Thread(target=self._write, args=(snapshot,), name=f"checkpoint-{snapshot.step}")
        self._thread.start()

    def _write(self, snapshot: Snapshot) -> None:
        try:
            self._written.append((snapshot.step, write_snapshot(self.checkpoint_dir, self.processes, snapshot, self.keep)))
        except BaseException as error:  # noqa: BLE001 - handed to the training thread by check()/wait()
            self._error = error

    def check(self) -> None:
        """Raise the error of a write that failed, if one did (cheap: called every step)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing the checkpoint of step {self._step} failed: "
                                  f"{type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def finished(self) -> list[tuple[int, Path]]:
        """(step, directory) of each checkpoint published since the last call, oldest first: the
        training thread logs them, so log lines never interleave."""
        done = []
        while self._written:
            done.append(self._written.popleft())
        return done
