"""trainer.runtime.watchdog: a process whose loop stops stepping ends with its stacks, a reason and status 1."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainer import container
from trainer.jobs import step, train
from trainer.runtime import watchdog

REPO_ROOT = Path(__file__).resolve().parents[2]

STUCK = """
import time
from trainer.runtime.watchdog import training_watchdog

def waiting_for_a_peer():
    print("waiting", flush=True); time.sleep(120)  # one line: a stack dumped once "waiting" is out shows it

guard = training_watchdog(0.02, rank=3, step=40)  # 1.2 s per step, 2.4 s before the first
guard.pet(41)
waiting_for_a_peer()
"""

PETTED = """
import time
from trainer.runtime.watchdog import Watchdog

guard = Watchdog(0.5, lambda step: f"fired after step {step}")
for step in range(1, 16):  # 1.5 s of steps 0.1 s apart
    time.sleep(0.1)
    guard.pet(step)
guard.stop()
time.sleep(1.0)  # past the deadline the last pet set
"""


def python(script: str, output_dir: Path, **popen) -> subprocess.Popen:
    environment = {**os.environ, "SM_OUTPUT_DIR": str(output_dir), "SM_CURRENT_HOST": "algo-2"}
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def watchdog_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "watchdog" and thread.is_alive()]


def test_no_step_within_the_deadline_dumps_the_stacks_writes_the_reason_and_exits_1(tmp_path):
    process = python(STUCK, tmp_path)
    _, stderr = process.communicate(timeout=120)
    reason = "WatchdogTimeout: no optimizer step for 0.02 min on algo-2 rank 3; last step 41"
    assert process.returncode == 1
    assert (tmp_path / "failure").read_text() == reason + "\n"
    assert f"{reason}; the stacks of this process's threads follow" in stderr
    assert 'File "<string>", line 6 in waiting_for_a_peer' in stderr  # the main thread, where it is stuck


def test_a_loop_that_keeps_stepping_is_left_alone_and_a_stopped_watchdog_never_fires(tmp_path):
    process = python(PETTED, tmp_path)
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (0, "")
    assert not (tmp_path / "failure").exists()


def test_a_rank_stopped_by_sigterm_dumps_its_stacks_on_the_way_out(tmp_path):
    # torchrun stops a host's other ranks with SIGTERM when one exits: they log their stacks too
    process = python(STUCK.replace("0.02", "10"), tmp_path)
    # the signal comes once the rank is in the wait (under load it used to land while `print` still ran
    # at module level, and the stack showed no waiting_for_a_peer)
    assert process.stdout.readline() == "waiting\n"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM
    assert 'File "<string>", line 6 in waiting_for_a_peer' in stderr
    assert not (tmp_path / "failure").exists()


def test_zero_minutes_watches_nothing():
    guard = watchdog.training_watchdog(0, rank=0, step=0)
    assert watchdog_threads() == []
    guard.pet(1)
    guard.stop()


def test_a_training_run_that_raises_leaves_no_watchdog_running(tmp_path, shards_dir, train_args, monkeypatch):
    # a caller that goes on after the error (this test process) must not be ended by the timer later
    def failing_loss(*args, **kwargs):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(step, "diffusion_loss", failing_loss)
    try:
        with pytest.raises(RuntimeError, match="the step failed"):
            train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3"))
        assert watchdog_threads() == []
    finally:
        for guard in list(watchdog._running):  # only if the assertion failed
            guard.stop()


def test_the_training_loop_pets_the_watchdog_after_every_step(tmp_path, shards_dir, train_args, monkeypatch):
    pets, real_pet = [], watchdog.Watchdog.pet
    monkeypatch.setattr(watchdog.Watchdog, "pet", lambda guard, step: (pets.append(step), real_pet(guard, step)))
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "10"))
    assert pets == [1, 2, 3]
    assert watchdog_threads() == []  # stopped before the pipeline is saved


def test_the_watchdog_and_preflight_hyperparameters_are_checked_before_anything_starts(tmp_path):
    argv = ["--train-dir", str(tmp_path), "--model-dir", str(tmp_path)]
    assert container.parse_training_args([*argv, "--watchdog-minutes", "45", "--preflight-timeout", "30"]).watchdog_minutes == 45
    with pytest.raises(ValueError, match="--watchdog-minutes must be >= 0"):
        container.parse_training_args([*argv, "--watchdog-minutes", "-1"])
