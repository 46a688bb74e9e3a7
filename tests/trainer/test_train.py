"""trainer.jobs.train: tiny runs on the CPU; checkpoints, exact resume, stages, SDXL, DDP/FSDP, health."""

import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, DiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from PIL import Image
from safetensors.torch import load_file

from contracts.metrics import METRIC_DEFINITIONS
from trainer.jobs import step, train
from trainer.jobs.encode import encode_shards
from trainer.models import text_tokenizers
from trainer.models.loading import load_models
from trainer.objectives import diffusion as objective
from trainer.runtime.checkpoints import CheckpointError, checkpoint_to_resume, load_checkpoint
from trainer.runtime.distributed import Processes
from trainer.runtime.ema import EMA
from trainer.runtime.health import NonFiniteLossError
from trainer.runtime.health import grid_layout
from trainer.speed.vae_compile import compile_vae_encoder

pytestmark = pytest.mark.slow(seconds=40)
REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def events(lines: list[dict]) -> dict[str, dict]:
    """The setup events before the first step, by name (each shows once)."""
    setup = lines[:next((n for n, line in enumerate(lines) if "loss" in line), len(lines))]
    return {line["event"]: line for line in setup if "event" in line}


def losses(lines: list[dict]) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def unet_weights(directory: Path) -> dict:
    return load_file(directory / "diffusion_pytorch_model.safetensors")


@pytest.fixture
def record_batches(monkeypatch):
    """Every micro-batch the loss sees; `nan_steps` makes those calls' losses NaN (1-based call numbers)."""
    seen, real_loss = [], step.diffusion_loss

    def recording_loss(*args, **kwargs):
        seen.append(args[2])
        loss = real_loss(*args, **kwargs)
        if recording_loss.always_nan:
            return loss + float("nan")  # the loss alone, the gradients stay finite
        return loss * float("nan") if len(seen) in recording_loss.nan_steps else loss  # gradients NaN too

    recording_loss.nan_steps, recording_loss.always_nan = set(), False
    monkeypatch.setattr(step, "diffusion_loss", recording_loss)
    return seen, recording_loss


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
    assert (ema.decay, ema.updates) == (0.9999, 2)
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


# ---------------------------------------------------------------- models and objective


def test_training_changes_the_unet_and_the_loss_is_finite(trained):
    trained_unet = unet_weights(trained["model_dir"] / "unet")
    initial_unet = load_models("tiny", None, seed=0).denoiser.state_dict()
    assert any(not torch.equal(value, trained_unet[name]) for name, value in initial_unet.items())
    assert torch.isfinite(torch.tensor(trained["record"]["final_loss"]))


def test_the_saved_pipeline_holds_the_ema_weights(trained):
    saved = unet_weights(trained["model_dir"] / "unet")
    ema = unet_weights(trained["checkpoint_dir"] / "step-00000003" / "ema_unet")
    raw = unet_weights(trained["checkpoint_dir"] / "step-00000003" / "unet")
    assert all(torch.equal(value, ema[name]) for name, value in saved.items())
    assert any(not torch.equal(value, raw[name]) for name, value in saved.items())


def test_the_training_record_lists_args_steps_loss_stages_and_shards(trained):
    record = json.loads((trained["model_dir"] / "atelier-training.json").read_text())
    assert record == json.loads(json.dumps(trained["record"]))
    assert (record["steps"], record["weights"], record["skipped_steps"], record["corrupt_samples"]) == (3, "ema", 0, [])
    assert record["args"]["batch_size"] == 2
    assert record["stages"][0]["resolution"] == 32
    assert set(record["shards_seen"]) <= {"shard-a.tar", "shard-b.tar"} and record["shards_seen"]


def test_the_saved_pipeline_loads_and_generates_an_image_of_the_model_size(trained):
    pipeline = DiffusionPipeline.from_pretrained(trained["model_dir"])
    assert isinstance(pipeline.scheduler, DDIMScheduler)
    assert pipeline.tokenizer.model_max_length == 77
    image = pipeline("a red dog", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)  # the resolution the run trained at (the saved UNet's sample_size: 8x8 latents)


def test_health_a_loss_curve_and_a_validation_grid_per_checkpoint(trained):
    health = trained["model_dir"] / "health"
    assert Image.open(health / "loss.png").size == (800, 400)
    grids = sorted(path.name for path in (health / "validation").iterdir())
    assert grids == ["step-00000002.png", "step-00000003.png"]
    assert Image.open(health / "validation" / grids[0]).size == grid_layout(32, 2, 1).size  # 2 prompts x 1 seed at 32 px


def tensorboard_events(folder: Path) -> list:
    """Every Event in the folder's event files (TFRecord framing: length, its CRC, the Event, its CRC)."""
    from tensorboardX.proto import event_pb2
    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
            offset += 12 + length + 4
    return events


def test_tensorboard_holds_every_logged_figure_and_each_checkpoint_s_validation_grid(trained):
    events = tensorboard_events(trained["model_dir"] / "health" / "tensorboard")
    scalars = {(value.tag, event.step): value.simple_value for event in events for value in event.summary.value
               if value.HasField("simple_value")}
    history = json.loads((trained["model_dir"] / "atelier-training.json").read_text())["history"]
    for figures in history:  # the all-rank means the log lines carry, at the same steps
        for name in ("loss", "img_per_s", "data_wait_share"):
            assert scalars[(f"train/{name}", figures["step"])] == pytest.approx(figures[name], rel=1e-6)
    assert {step for tag, step in scalars if tag == "train/lr"} == {1, 2, 3}
    grids = {event.step: value.image for event in events for value in event.summary.value if value.HasField("image")}
    assert sorted(grids) == [2, 3]
    width, height = grid_layout(32, 2, 1).size
    assert (grids[2].width, grids[2].height) == (width, height)
    assert Image.open(io.BytesIO(grids[2].encoded_image_string)).size == (width, height)


def test_tensorboard_none_writes_no_event_files(tmp_path, shards_dir, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--tensorboard-dir", "none"))
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_the_run_s_report_is_written_beside_the_model_with_every_logged_step_and_grid(trained):
    model_dir = trained["model_dir"]
    page = (model_dir / "report.html").read_text()
    history = json.loads((model_dir / "atelier-training.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3]  # --log-every 1 over three steps
    assert page == (model_dir / "health" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and page.count("<polyline") == 3


def test_the_same_seed_trains_the_same_weights(tmp_path, shards_dir, trained, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "2",
                          "--validation-prompts", "a red dog|a blue cat"))
    again, first = unet_weights(tmp_path / "model" / "unet"), unet_weights(trained["model_dir"] / "unet")
    assert all(torch.equal(value, first[name]) for name, value in again.items())


def test_sdxl_trains_with_size_and_crop_conditioning_and_saves_an_sdxl_pipeline(tmp_path, shards_dir, train_args, record_batches):
    seen, _ = record_batches
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "2", "--model-config", "tiny-sdxl",
                          "--random-crop", "true"))
    assert all(batch["time_ids"].shape == (2, 6) for batch in seen)
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "model")
    assert isinstance(pipeline, StableDiffusionXLPipeline)
    image = pipeline("a red dog", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)  # the resolution the run trained at


def test_accumulation_checkpointing_min_snr_and_noise_offset_train(tmp_path, shards_dir, capsys, train_args, record_batches):
    seen, _ = record_batches
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "2",
                                   "--gradient-accumulation", "2", "--gradient-checkpointing", "true",
                                   "--snr-gamma", "5", "--noise-offset", "0.05"))
    assert len(seen) == 4 and seen[0]["key"] != seen[1]["key"]
    assert [line["step"] for line in json_lines(capsys.readouterr().out) if "loss" in line] == [1, 2]
    assert torch.isfinite(torch.tensor(record["final_loss"]))


def test_v_prediction_is_carried_into_the_saved_scheduler(tmp_path, shards_dir, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--prediction-type", "v_prediction"))
    config = json.loads((tmp_path / "model" / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "v_prediction"


def zero_unet(noisy_latents, timesteps, context, added_cond_kwargs=None):
    """A UNet stand-in that predicts zeros: the loss is then the mean square of the target."""
    zero_unet.seen = timesteps
    return type("Output", (), {"sample": torch.zeros_like(noisy_latents)})


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_the_loss_targets_the_noise_or_the_velocity(prediction_type):
    models = load_models("tiny", None, seed=0)
    models.noise_scheduler.register_to_config(prediction_type=prediction_type)
    batch = {"pixel_values": torch.zeros(2, 3, 16, 16), "caption": ["a dog", "a cat"]}
    loss = objective.diffusion_loss(zero_unet, models, batch, torch.device("cpu"), torch.Generator().manual_seed(5))
    # WHEN the same draws are replayed by hand
    generator = torch.Generator().manual_seed(5)
    latents = models.vae.encode(batch["pixel_values"]).latent_dist.sample(generator=generator) * models.vae.config.scaling_factor
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (2,), generator=generator)
    target = models.noise_scheduler.get_velocity(latents, noise, timesteps) if prediction_type == "v_prediction" else noise
    # THEN the loss is the target's mean square
    assert torch.equal(zero_unet.seen, timesteps)
    assert loss.item() == pytest.approx(target.pow(2).mean().item(), rel=1e-5)


def test_min_snr_weights_cap_the_easy_timesteps():
    scheduler = load_models("tiny", None, seed=0).noise_scheduler
    timesteps = torch.tensor([0, 500, 999])
    snr = scheduler.alphas_cumprod[timesteps] / (1 - scheduler.alphas_cumprod[timesteps])
    epsilon = objective.min_snr_weights(scheduler, timesteps, 5.0, v_prediction=False)
    assert torch.allclose(epsilon, torch.clamp(snr, max=5.0) / snr)
    assert epsilon[0] < 0.01 and epsilon[2] == 1.0  # low noise (high SNR) weighed down; high noise as is
    velocity = objective.min_snr_weights(scheduler, timesteps, 5.0, v_prediction=True)
    assert torch.allclose(velocity, torch.clamp(snr, max=5.0) / (snr + 1))


def test_noise_offset_shifts_each_channel_of_the_noise():
    models = load_models("tiny", None, seed=0)
    batch = {"pixel_values": torch.zeros(1, 3, 16, 16), "caption": ["a dog"]}
    plain = objective.diffusion_loss(zero_unet, models, batch, torch.device("cpu"), torch.Generator().manual_seed(1))
    offset = objective.diffusion_loss(zero_unet, models, batch, torch.device("cpu"), torch.Generator().manual_seed(1), noise_offset=1.0)
    assert offset.item() > plain.item()


def test_unknown_model_config_names_the_presets():
    with pytest.raises(ValueError, match="unknown model config 'huge'; presets: pixart-sigma, sd2, sd3-medium, sdxl, "
                                         "small, tiny, tiny-pixart, tiny-sd3, tiny-sdxl"):
        load_models("huge", None, seed=0)


def test_pretrained_loads_a_pipeline_directory_or_a_channel(trained, monkeypatch, tmp_path):
    models = load_models("tiny", str(trained["model_dir"]), seed=0)
    saved = unet_weights(trained["model_dir"] / "unet")
    assert all(torch.equal(value, saved[name]) for name, value in models.denoiser.state_dict().items())
    monkeypatch.setenv("SM_CHANNEL_PRETRAINED", str(trained["model_dir"]))
    assert load_models("tiny", "pretrained", seed=0).denoiser.config == models.denoiser.config
    with pytest.raises(ValueError, match=f"--pretrained {tmp_path} is not a diffusers pipeline directory or channel"):
        load_models("tiny", str(tmp_path), seed=0)


# ---------------------------------------------------------------- health


def test_a_non_finite_step_is_skipped_and_training_goes_on(tmp_path, shards_dir, capsys, train_args, record_batches):
    _, loss_function = record_batches
    loss_function.nan_steps = {2}
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3"))
    lines = json_lines(capsys.readouterr().out)
    assert [line for line in lines if line.get("event") == "skipped_step"] == [
        {"event": "skipped_step", "step": 2, "reason": "non-finite loss or gradient", "in_a_row": 1}]
    assert losses(lines)[2] is None and losses(lines)[3] is not None
    assert record["skipped_steps"] == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_repeated_non_finite_steps_end_the_job_with_a_failure_reason(tmp_path, shards_dir, monkeypatch, train_args, record_batches):
    _, loss_function = record_batches
    loss_function.always_nan = True
    monkeypatch.setenv("SM_OUTPUT_DIR", str(tmp_path / "output"))
    with pytest.raises(NonFiniteLossError):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "10", "--max-nonfinite-steps", "3",
                              "--validation-prompts", ""))
    assert (tmp_path / "output" / "failure").read_text() == (
        "NonFiniteLossError: 3 steps in a row up to step 3 had a NaN or infinite loss or gradient\n")


def test_log_lines_carry_the_metric_fields(trained, tmp_path, shards_dir, capsys, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--resume", "none"))
    (line,) = [line for line in json_lines(capsys.readouterr().out) if "loss" in line]
    assert set(line) == {"step", "stage", "loss", "lr", "grad_norm", "img_per_s", "data_wait_share", "skipped_steps", "corrupt_samples",
                         "steps", "progress", "eta_s"}
    assert (line["steps"], line["progress"], line["eta_s"]) == (1, 1.0, 0.0)


def test_progress_is_steps_done_over_total_and_the_eta_follows_the_recent_step_rate():
    # 10 steps in the last 5 s: 2 steps/s, 70 steps left
    assert train.progress_and_eta(30, 100, 10, 5.0) == {"steps": 100, "progress": 0.3, "eta_s": 35.0}
    assert train.progress_and_eta(100, 100, 10, 5.0) == {"steps": 100, "progress": 1.0, "eta_s": 0.0}
    assert train.progress_and_eta(1, 3, 0, 0.0)["eta_s"] is None  # no steps measured yet: no rate, no guess


def test_the_metric_regexes_read_each_figure_from_a_log_line_and_not_from_other_events():
    line = json.dumps({"step": 20, "stage": 0, "lr": 1e-05, "loss": 0.123456, "grad_norm": 2.5, "img_per_s": 812.3,
                       "data_wait_share": 0.0012, "skipped_steps": 0, "corrupt_samples": 3})
    read = {definition["Name"]: re.search(definition["Regex"], line).group(1) for definition in METRIC_DEFINITIONS}
    assert {name: float(value) for name, value in read.items()} == {
        "train:loss": 0.123456, "train:lr": 1e-05, "train:grad_norm": 2.5, "train:img_per_s": 812.3,
        "train:data_wait_share": 0.0012, "train:skipped_steps": 0, "train:corrupt_samples": 3,
    }
    saved = json.dumps({"event": "saved", "model_dir": "/opt/ml/model", "steps": 20, "final_loss": 0.1})
    assert all(re.search(definition["Regex"], saved) is None for definition in METRIC_DEFINITIONS)
    docs = (REPO_ROOT / "docs" / "trainer.md").read_text()
    assert all(json.dumps(definition) in docs for definition in METRIC_DEFINITIONS)


# ---------------------------------------------------------------- arguments


def test_hyperparameters_in_sm_hps_become_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("SM_HPS", json.dumps({"batch-size": "3", "learning-rate": "0.001", "aspect-buckets": "false",
                                             "sagemaker_program": "x"}))
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "train"))
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    args = train.parse_args(["--steps", "7"])
    assert (args.batch_size, args.learning_rate, args.steps, args.aspect_buckets) == (3, 0.001, 7, False)
    assert (args.train_dir, args.model_dir) == (str(tmp_path / "train"), str(tmp_path / "model"))
    assert not hasattr(args, "sagemaker_program")


# ---------------------------------------------------------------- several processes


def torchrun(tmp_path: Path, shards_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "trainer.jobs.train",
        "--train-dir", str(shards_dir), "--model-dir", str(tmp_path / "model"),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
        "--batch-size", "2", "--resolution", "32", "--num-workers", "0", "--log-every", "1",
        "--validation-prompts", "a dog", "--validation-seeds", "0", "--validation-inference-steps", "2", *extra,
    ]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)  # two processes on a loaded 2-core CI machine


def test_two_processes_train_with_ddp_and_a_checkpoint_resumes_with_fsdp_and_with_one_process(
        tmp_path, shards_dir, capsys, train_args):
    # GIVEN two CPU processes under torchrun (gloo, DDP), one shard each
    result = torchrun(tmp_path, shards_dir, "--steps", "2")
    # THEN one log, one checkpoint holding both ranks' RNG, and both shards in the record
    assert result.returncode == 0, result.stderr[-3000:]
    lines = json_lines(result.stdout)
    assert list(losses(lines)) == [1, 2]
    start = next(line for line in lines if line.get("event") == "start")
    assert (start["world_size"], start["backend"], start["strategy"]) == (2, "gloo", "ddp")
    assert list(start["preflight"]) == ["all_reduce_s"]  # the preflight's all-reduce ran over both processes
    checkpoint = tmp_path / "ckpt" / "step-00000002"
    assert sorted(path.name for path in checkpoint.iterdir()) == ["ema_unet", "manifest.json", "rng-rank0.pt", "rng-rank1.pt", "training_state.pt", "unet"]
    assert {"rng-rank0.pt", "rng-rank1.pt"} <= {entry["path"] for entry in json.loads((checkpoint / "manifest.json").read_text())["files"]}
    rng = [torch.load(checkpoint / f"rng-rank{rank}.pt", weights_only=False)["torch"] for rank in (0, 1)]
    assert not torch.equal(*rng)  # each rank draws its own noise
    record = json.loads((tmp_path / "model" / "atelier-training.json").read_text())
    assert record["shards_seen"] == ["shard-a.tar", "shard-b.tar"]
    # WHEN the checkpoint is resumed by two FSDP processes
    result = torchrun(tmp_path, shards_dir, "--steps", "3", "--strategy", "fsdp")
    # THEN they continue at step 3 with sharded weights and write a checkpoint that loads as a UNet
    assert result.returncode == 0, result.stderr[-3000:]
    lines = json_lines(result.stdout)
    assert events(lines)["resumed"]["step"] == 2 and list(losses(lines)) == [3]
    UNet2DConditionModel.from_pretrained(tmp_path / "ckpt" / "step-00000003" / "unet")
    # WHEN that checkpoint is resumed by a single process
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "4"))
    # THEN it continues at step 4
    assert list(losses(json_lines(capsys.readouterr().out))) == [4]


@pytest.mark.parametrize("kind", ["image", "latent"])
def test_compile_compiles_the_vae_encoder_on_image_shards_only(kind, tmp_path, shards_dir, monkeypatch, train_args):
    """--compile: the UNet step, and the VAE encoder where it runs every step (image shards); the run still saves."""
    compiled, real_compile = [], torch.compile

    def compile_unet(model, **options):  # the UNet stays eager (inductor on a CPU needs minutes); the rest is real
        if not isinstance(model, torch.nn.Module):
            return real_compile(model, **options)
        compiled.append(type(model).__name__)
        return model

    monkeypatch.setattr(torch, "compile", compile_unet)

    def recording(models, channels_last=False, backend="inductor"):
        compiled.append("vae encoder")
        compile_vae_encoder(models, channels_last, backend="aot_eager")  # traced for real; no C++ compiler needed

    monkeypatch.setattr(train, "compile_vae_encoder", recording)
    train_dir, tokenizer = shards_dir, []
    if kind == "latent":  # encoded with tokenizers learned from no captions, which the run then takes as --tokenizer
        models = load_models("tiny", None, seed=0)
        train_dir = encode_shards(shards_dir, tmp_path / "latents", models, 32, torch.device("cpu"), batch_size=2,
                                  num_workers=0)["dir"]
        text_tokenizers.save({"tokenizer": models.tokenizers[0]}, tmp_path / "tokenizer")
        tokenizer = ["--tokenizer", str(tmp_path / "tokenizer")]
    args = train_args(train_dir, tmp_path / "model", tmp_path / "checkpoints", "--steps", "1", "--compile", "true",
                      *tokenizer)
    train.main(args)

    assert compiled == (["UNet2DConditionModel", "vae encoder"] if kind == "image" else ["UNet2DConditionModel"])
    assert (tmp_path / "model" / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    torch._dynamo.reset()
