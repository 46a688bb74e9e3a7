"""trainer.jobs.train: tiny runs on the CPU; checkpoints, exact resume, stages handing off."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from PIL import Image

from trainer.jobs import train
from trainer.models.loading import load_models
from trainer.runtime.checkpoints import CheckpointError, checkpoint_to_resume, load_checkpoint
from trainer.runtime.ema import EMA
from trainer.runtime.health import grid_layout
from tests.trainer.train_helpers import (  # noqa: F401  (record_batches: fixtures)
    CPU,
    REPO_ROOT,
    events,
    json_lines,
    losses,
    record_batches,
    unet_weights,
)

pytestmark = pytest.mark.slow(seconds=25)


# ---------------------------------------------------------------- checkpoints


def test_checkpoints_every_n_steps_and_at_the_end_with_latest_marking_the_last(trained):
    checkpoint_dir = trained["checkpoint_dir"]
    assert sorted(path.name for path in checkpoint_dir.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert (checkpoint_dir / "latest").read_text() == "step-00000003"
    assert sorted(path.name for path in (checkpoint_dir / "step-00000003").iterdir()) == [
        "ema_unet", "manifest.json", "rng-rank0.pt", "training_state.pt", "unet",
    ]
    # both weight directories load as UNets on their own
    UNet2DConditionModel.from_pretrained(checkpoint_dir / "step-00000003" / "ema_unet")


def test_a_checkpoint_stores_step_stage_args_optimizer_scheduler_and_ema(trained):
    state = torch.load(trained["checkpoint_dir"] / "step-00000002" / "training_state.pt", weights_only=False)
    assert (state["step"], state["stage"]) == (2, 0)
    assert state["args"]["model_config"] == "tiny" and state["args"]["steps"] == 3
    assert all(param["step"] == 2 for param in state["optimizer"]["state"].values())
    assert state["lr_scheduler"]["last_epoch"] == 2
    assert state["ema"] == {"decay": 0.9999, "updates": 2}
    assert [step for step, _ in state["loss_history"]] == [1, 2]
    assert set(state["shards_seen"]) <= {"shard-a.tar", "shard-b.tar"} and state["shards_seen"]


def test_only_the_newest_checkpoints_are_kept(tmp_path, shards_dir, train_args):
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "1",
                      "--validation-prompts", "")
    train.main(args)
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["latest", "step-00000002", "step-00000003"]


def test_a_checkpoint_cut_off_midway_leaves_latest_on_the_previous_one(tmp_path, shards_dir, monkeypatch, train_args):
    # GIVEN a run whose second checkpoint dies while being written
    real_save = torch.save

    def save_or_die(obj, path, *args, **kwargs):
        if isinstance(path, Path) and path.name == "training_state.pt" and "step-00000002" in str(path):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_or_die)
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "1",
                      "--validation-prompts", "")
    # WHEN it runs
    with pytest.raises(CheckpointError, match="checkpoint of step 2 failed: OSError: disk full"):
        train.main(args)
    # THEN `latest` still names the complete step-1 checkpoint, and resuming starts from it
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000001"
    assert sorted(path.name for path in (tmp_path / "ckpt").glob("step-*")) == ["step-00000001"]
    assert checkpoint_to_resume("latest", tmp_path / "ckpt") == tmp_path / "ckpt" / "step-00000001"


def test_loading_a_checkpoint_restores_weights_optimizer_scheduler_ema_and_rng(trained):
    checkpoint = trained["checkpoint_dir"] / "step-00000002"
    models = load_models("tiny", None, seed=123)  # other weights than the run's
    optimizer = torch.optim.AdamW(models.denoiser.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1e-4)
    ema = EMA(models.denoiser.named_parameters(), 0.5)
    state = load_checkpoint(checkpoint, CPU, models.denoiser, optimizer, schedule, ema)
    saved = unet_weights(checkpoint / "unet")
    assert state["step"] == 2
    assert all(torch.equal(value, saved[name]) for name, value in models.denoiser.state_dict().items())
    assert all(param["step"] == 2 for param in optimizer.state_dict()["state"].values())
    assert schedule.last_epoch == 2
    saved_ema = unet_weights(checkpoint / "ema_unet")
    assert (ema.decay, ema.updates) == (0.5, 2)  # the count resumes; the decay is this run's (--ema-decay), not the saved 0.9999
    assert all(torch.equal(shadow, saved_ema[name]) for name, shadow in ema.shadow.items())
    assert torch.equal(torch.get_rng_state(), torch.load(checkpoint / "rng-rank0.pt", weights_only=False)["torch"])


# ---------------------------------------------------------------- resume


def test_resume_latest_continues_at_the_next_step(trained, tmp_path, shards_dir, capsys, train_args):
    # GIVEN the run's checkpoints (latest: step 3)
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    # WHEN the same run is started again for 5 steps
    record = train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "5", "--checkpoint-every", "2"))
    # THEN it resumes from step 3, trains steps 4 and 5, and checkpoints at 4 and 5
    lines = json_lines(capsys.readouterr().out)
    assert events(lines)["resumed"] == {"event": "resumed", "checkpoint": str(checkpoint_dir / "step-00000003"), "step": 3, "stage": 0}
    assert list(losses(lines)) == [4, 5]
    assert record["steps"] == 5
    assert (checkpoint_dir / "latest").read_text() == "step-00000005"
    assert sorted(path.name for path in checkpoint_dir.glob("step-*")) == ["step-00000004", "step-00000005"]


def test_a_killed_run_resumed_from_latest_repeats_the_uninterrupted_loss_curve(tmp_path, shards_dir, capsys, train_args):
    steps = ["--steps", "6", "--checkpoint-every", "3", "--num-workers", "2"]
    # GIVEN the losses of an uninterrupted run of 6 steps
    train.main(train_args(shards_dir, tmp_path / "straight", tmp_path / "straight-ckpt", *steps))
    straight = losses(json_lines(capsys.readouterr().out))
    # WHEN the same run, in its own process, is killed (SIGKILL) once it has checkpointed step 3
    command = [sys.executable, "-m", "trainer.jobs.train", *cli(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", *steps))]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    before_kill = []
    for line in process.stdout:
        before_kill += json_lines(line)
        if before_kill[-1:] and before_kill[-1].get("event") == "checkpoint":
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    # ... and started again
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", *steps))
    after = json_lines(capsys.readouterr().out)
    # THEN it resumed from a checkpoint and every step, before and after the kill, has the same loss
    resumed_at = events(after)["resumed"]["step"]
    assert resumed_at >= 3
    assert list(losses(after)) == list(range(resumed_at + 1, 7))
    assert losses(before_kill).items() <= straight.items() and losses(after).items() <= straight.items()
    assert set(losses(before_kill)) | set(losses(after)) == set(straight) == set(range(1, 7))
    # and the saved weights are bit for bit the uninterrupted run's
    resumed_unet, straight_unet = unet_weights(tmp_path / "model" / "unet"), unet_weights(tmp_path / "straight" / "unet")
    assert all(torch.equal(value, straight_unet[name]) for name, value in resumed_unet.items())


def cli(args) -> list[str]:
    """Parsed arguments back into a command line."""
    argv = []
    for name, value in vars(args).items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def test_a_finished_run_started_again_only_saves_the_pipeline(trained, tmp_path, shards_dir, capsys, train_args):
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    record = train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "3"))
    assert losses(json_lines(capsys.readouterr().out)) == {}
    assert record["steps"] == 3
    assert record["final_loss"] == trained["record"]["final_loss"]
    saved, original = unet_weights(tmp_path / "model" / "unet"), unet_weights(trained["model_dir"] / "unet")
    assert all(torch.equal(value, original[name]) for name, value in saved.items())


def test_resume_none_starts_over(trained, tmp_path, shards_dir, capsys, train_args):
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "1", "--resume", "none"))
    assert list(losses(json_lines(capsys.readouterr().out))) == [1]


# ---------------------------------------------------------------- stages


def test_stages_hand_off_by_themselves_and_a_resumed_job_continues_in_the_right_stage(
        tmp_path, shards_dir, capsys, train_args, record_batches):
    # GIVEN a run config of two stages: 32 px batches of 2 at lr 1e-3, then 64 px batches of 1 at 5e-4
    run_config = tmp_path / "two-stages.json"
    run_config.write_text(json.dumps({"stages": [
        {"resolution": 32, "batch_size": 2, "learning_rate": 1e-3, "steps": 2},
        {"resolution": 64, "batch_size": 1, "learning_rate": 5e-4, "steps": 2},
    ]}))
    argv = ["--run-config", str(run_config), "--checkpoint-every", "3", "--aspect-buckets", "false",
            "--validation-prompts", "a red dog|a blue cat"]
    seen, _ = record_batches
    # WHEN it runs (no --steps, --batch-size, --resolution or --learning-rate)
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", *argv)
    args.resolution = args.batch_size = None
    train.main(args)
    lines = json_lines(capsys.readouterr().out)
    # THEN it moves to stage 1 at step 3, with that stage's image size, batch size and learning rate
    assert [(line["step"], line["stage"], line["resolution"]) for line in lines if line.get("event") == "stage"] == [(1, 0, 32), (3, 1, 64)]
    assert [tuple(batch["pixel_values"].shape) for batch in seen] == [(2, 3, 32, 32)] * 2 + [(1, 3, 64, 64)] * 2
    assert [line["lr"] for line in lines if "loss" in line] == [1e-3, 1e-3, 5e-4, 5e-4]
    assert Image.open(tmp_path / "model" / "health" / "validation" / "step-00000003.png").size == grid_layout(64, 2, 1).size
    # WHEN it is resumed from its step-3 checkpoint
    straight = losses(lines)
    args.resume = str(tmp_path / "ckpt" / "step-00000003")
    train.main(args)
    resumed = json_lines(capsys.readouterr().out)
    # THEN it continues in stage 1 and repeats step 4 exactly
    assert [(line["step"], line["stage"]) for line in resumed if line.get("event") == "stage"] == [(4, 1)]
    assert losses(resumed) == {4: straight[4]}


def test_a_rank_s_generators_restore_on_a_host_with_fewer_gpus(monkeypatch):
    """A rank saves its own GPU's generator alone and restores it into its own device; a file of before, with
    every visible GPU's state (8 here), restores only this process's (device 3), on a host of any size."""
    from trainer.runtime import checkpoints
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([3], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(int(state[0])))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every device's generator set"))
    states = checkpoints.rng_states()
    assert int(states["cuda"][0]) == 3
    checkpoints.restore_rng_states(states)
    checkpoints.restore_rng_states({**states, "cuda": [torch.tensor([n], dtype=torch.uint8) for n in range(8)]})
    checkpoints.restore_rng_states({**states, "cuda": [torch.tensor([0], dtype=torch.uint8)]})  # a 1-GPU file: not ours
    checkpoints.restore_rng_states({**states, "cuda": []})  # written on a CPU host
    assert restored == [3, 3]
