"""trainer.runtime.checkpoint_writer: a checkpoint written while training goes on holds its own step's state."""

import json
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trainer.jobs import train
from trainer.runtime import checkpoint_writer, checkpoints
from trainer.runtime.checkpoints import WEIGHTS_NAME, CheckpointError, checkpoint_to_resume

STEPS = ["--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "10"]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def contents(step_dir) -> dict:
    """What a checkpoint holds, its files' bytes aside: weights, EMA, optimizer, RNG and run state."""
    state = torch.load(step_dir / "training_state.pt", weights_only=False)
    state["args"] = {key: value for key, value in state["args"].items()
                     if key not in ("async_checkpoints", "model_dir", "checkpoint_dir")}
    state["history"] = [(entry["step"], entry["loss"]) for entry in state["history"]]  # less the timings
    return {"unet": load_file(step_dir / "unet" / WEIGHTS_NAME), "ema": load_file(step_dir / "ema_unet" / WEIGHTS_NAME),
            "state": state, "rng": torch.load(step_dir / "rng-rank0.pt", weights_only=False)}


def assert_same(left, right, where="") -> None:
    if isinstance(left, torch.Tensor):
        assert torch.equal(left, right), where
    elif isinstance(left, np.ndarray):
        assert np.array_equal(left, right), where
    elif isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_same(left[key], right[key], f"{where}/{key}")
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right), where
        for number, (a, b) in enumerate(zip(left, right)):
            assert_same(a, b, f"{where}[{number}]")
    else:
        assert left == right, where


@pytest.fixture(scope="module")
def in_place(tmp_path_factory, shards_dir, train_args) -> dict:
    """6 steps, a checkpoint every 2, each written before the next step (--async-checkpoints false)."""
    root = tmp_path_factory.mktemp("in-place")
    train.main(train_args(shards_dir, root / "model", root / "checkpoints", *STEPS, "--ema-decay", "0.9",
                          "--async-checkpoints", "false"))
    return {"checkpoint_dir": root / "checkpoints", "model_dir": root / "model"}


def test_a_checkpoint_written_while_later_steps_run_holds_the_state_of_its_own_step(
        in_place, tmp_path, shards_dir, train_args, monkeypatch, capsys):
    # GIVEN writes that start only once training has run two more steps past the checkpoint
    steps_done = []
    real_check = checkpoint_writer.CheckpointWriter.check

    def counting_check(self):  # called once per step by the loop
        steps_done.append(None)
        real_check(self)

    real_write = checkpoint_writer.write_snapshot
    overlapped = []

    def late_write(checkpoint_dir, processes, snapshot, keep):
        while len(steps_done) < min(snapshot.step + 2, 6) and threading.main_thread().is_alive():
            threading.Event().wait(0.01)
        overlapped.append(len(steps_done) - snapshot.step)  # steps run since the state was copied
        return real_write(checkpoint_dir, processes, snapshot, keep)

    monkeypatch.setattr(checkpoint_writer.CheckpointWriter, "check", counting_check)
    monkeypatch.setattr(checkpoint_writer, "write_snapshot", late_write)
    # WHEN the same run writes its checkpoints in the background
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *STEPS, "--ema-decay", "0.9"))
    lines = json_lines(capsys.readouterr().out)
    # THEN the writes of steps 2 and 4 overlapped later steps
    assert overlapped[:2] == [2, 2]
    # and every checkpoint holds exactly what the in-place run's holds at the same step
    for step in (2, 4, 6):
        name = f"step-{step:08d}"
        assert_same(contents(tmp_path / "checkpoints" / name), contents(in_place["checkpoint_dir"] / name), name)
        # whose unet file is the same bytes
        assert (tmp_path / "checkpoints" / name / "unet" / WEIGHTS_NAME).read_bytes() == \
            (in_place["checkpoint_dir"] / name / "unet" / WEIGHTS_NAME).read_bytes()
    # and each `checkpoint` line comes once its directory is complete, in step order
    assert [line["step"] for line in lines if line.get("event") == "checkpoint"] == [2, 4, 6]
    assert checkpoint_to_resume("latest", tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000006"


def test_a_checkpoint_write_that_fails_stops_the_job_with_its_cause(tmp_path, shards_dir, train_args, monkeypatch):
    # GIVEN a disk that fills up while the step-4 checkpoint is written
    real_save = checkpoints.save_unet

    def full_disk(directory, config, weights):
        if "step-00000004" in str(directory):
            raise OSError(28, "No space left on device")
        real_save(directory, config, weights)

    monkeypatch.setattr(checkpoints, "save_unet", full_disk)
    # WHEN a run checkpoints every 2 steps
    with pytest.raises(CheckpointError, match=r"step 4 failed: OSError: \[Errno 28\] No space left on device"):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *STEPS))
    # THEN the job stopped before its end, step 2 is complete and step 4 was never published
    assert not (tmp_path / "model" / "model_index.json").exists()
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert checkpoint_to_resume("latest", tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000002"


def test_the_next_checkpoint_waits_for_the_write_before_it(tmp_path, shards_dir, train_args, monkeypatch):
    # GIVEN writes that record when they run
    real_write = checkpoint_writer.write_snapshot
    running, overlaps = [], []

    def recorded(checkpoint_dir, processes, snapshot, keep):
        running.append(snapshot.step)
        overlaps.append(len(running))
        threading.Event().wait(0.05)
        try:
            return real_write(checkpoint_dir, processes, snapshot, keep)
        finally:
            running.remove(snapshot.step)

    monkeypatch.setattr(checkpoint_writer, "write_snapshot", recorded)
    # WHEN a run checkpoints at every step
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", "--steps", "5",
                          "--checkpoint-every", "1", "--keep-checkpoints", "10"))
    # THEN no two writes ever ran at once (one copy of the state at a time), and all five are there
    assert overlaps == [1] * 5
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 5
