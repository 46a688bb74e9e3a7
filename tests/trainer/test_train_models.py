"""trainer.jobs.train: tiny runs on the CPU; what it trains and saves, SDXL, the objective and its options."""

import io
import json
import struct
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, DiffusionPipeline, StableDiffusionXLPipeline
from PIL import Image

from tests.support import REPO
from trainer.jobs import train
from trainer.models.loading import load_models
from trainer.objectives import diffusion as objective
from trainer.runtime.health import grid_layout
from tests.trainer.train_helpers import (  # noqa: F401  (record_batches: fixtures)
    events,
    json_lines,
    record_batches,
    unet_weights,
)


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
    presets = sorted(path.stem for path in (REPO / "trainer" / "configs").glob("*.json"))
    assert {"pixart-sigma", "sd2", "sd3-medium", "sdxl", "small", "small-pixart", "tiny", "tiny-pixart"} <= set(presets)
    with pytest.raises(ValueError) as refused:
        load_models("huge", None, seed=0)
    assert str(refused.value) == f"unknown model config 'huge'; presets: {', '.join(presets)}"


def test_pretrained_loads_a_pipeline_directory_or_a_channel(trained, monkeypatch, tmp_path):
    models = load_models("tiny", str(trained["model_dir"]), seed=0)
    saved = unet_weights(trained["model_dir"] / "unet")
    assert all(torch.equal(value, saved[name]) for name, value in models.denoiser.state_dict().items())
    monkeypatch.setenv("SM_CHANNEL_PRETRAINED", str(trained["model_dir"]))
    assert load_models("tiny", "pretrained", seed=0).denoiser.config == models.denoiser.config
    with pytest.raises(ValueError, match=f"--pretrained {tmp_path} is not a diffusers pipeline directory or channel"):
        load_models("tiny", str(tmp_path), seed=0)
