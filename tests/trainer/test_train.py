"""trainer.train: two or three steps of the tiny model, checkpoints, resume, the saved pipeline."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image

from trainer import train
from trainer.models import load_models

REPO_ROOT = Path(__file__).resolve().parents[2]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_checkpoints_every_n_steps_and_at_the_end_with_latest_marking_the_last(trained):
    checkpoint_dir = trained["checkpoint_dir"]
    assert sorted(path.name for path in checkpoint_dir.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert (checkpoint_dir / "latest").read_text() == "step-00000003"
    assert sorted(path.name for path in (checkpoint_dir / "step-00000003").iterdir()) == [
        "rng-rank0.pt", "training_state.pt", "unet",
    ]


def test_a_checkpoint_stores_step_args_and_optimizer(trained):
    state = torch.load(trained["checkpoint_dir"] / "step-00000002" / "training_state.pt")
    assert state["step"] == 2
    assert state["args"]["model_config"] == "tiny"
    assert state["args"]["steps"] == 3
    assert state["shards_seen"]  # two batches of 2 from 2 shards of 3
    assert set(state["shards_seen"]) <= {"shard-a.tar", "shard-b.tar"}
    assert all(param["step"] == 2 for param in state["optimizer"]["state"].values())


def test_only_the_newest_checkpoints_are_kept(tmp_path, shards_dir, train_args):
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "1")
    train.main(args)
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["latest", "step-00000002", "step-00000003"]


def test_a_checkpoint_cut_off_midway_leaves_latest_on_the_previous_one(tmp_path, shards_dir, monkeypatch, train_args):
    # GIVEN a run whose second checkpoint dies while being written
    real_save = torch.save

    def save_or_die(obj, path, *args, **kwargs):
        if Path(path).name == "training_state.pt" and "step-00000002" in str(path):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_or_die)
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "1")
    # WHEN it runs
    with pytest.raises(OSError, match="disk full"):
        train.main(args)
    # THEN `latest` still names the complete step-1 checkpoint, and resuming starts from it
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000001"
    assert sorted(path.name for path in (tmp_path / "ckpt").glob("step-*")) == ["step-00000001"]
    assert train.checkpoint_to_resume("latest", tmp_path / "ckpt") == tmp_path / "ckpt" / "step-00000001"


def test_loading_a_checkpoint_restores_its_weights_optimizer_and_rng(trained):
    checkpoint = trained["checkpoint_dir"] / "step-00000002"
    models = load_models("tiny", None, seed=123)  # other weights than the run's
    optimizer = torch.optim.AdamW(models.unet.parameters(), lr=1e-4)
    state = train.load_checkpoint(checkpoint, 0, models.unet, optimizer)
    saved = UNet2DConditionModel.from_pretrained(checkpoint / "unet").state_dict()
    assert state["step"] == 2
    assert all(torch.equal(value, saved[name]) for name, value in models.unet.state_dict().items())
    assert all(param["step"] == 2 for param in optimizer.state_dict()["state"].values())
    assert torch.equal(torch.get_rng_state(), torch.load(checkpoint / "rng-rank0.pt")["torch"])


def test_resume_latest_continues_at_the_next_step(trained, tmp_path, shards_dir, capsys, train_args):
    # GIVEN the run's checkpoints (latest: step 3)
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    # WHEN the same run is started again for 5 steps
    record = train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "5", "--checkpoint-every", "2"))
    # THEN it resumes from step 3, trains steps 4 and 5, and checkpoints at 4 and 5
    lines = json_lines(capsys.readouterr().out)
    assert lines[0] == {"event": "resumed", "checkpoint": str(checkpoint_dir / "step-00000003"), "step": 3}
    assert [line["step"] for line in lines if "loss" in line] == [4, 5]
    assert record["steps"] == 5
    assert (checkpoint_dir / "latest").read_text() == "step-00000005"
    assert sorted(path.name for path in checkpoint_dir.glob("step-*")) == ["step-00000004", "step-00000005"]


def test_a_finished_run_started_again_only_saves_the_pipeline(trained, tmp_path, shards_dir, capsys, train_args):
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    record = train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "3"))
    lines = json_lines(capsys.readouterr().out)
    assert [line for line in lines if "loss" in line] == []
    assert record["steps"] == 3
    assert record["final_loss"] == trained["record"]["final_loss"]
    saved = UNet2DConditionModel.from_pretrained(tmp_path / "model" / "unet").state_dict()
    original = UNet2DConditionModel.from_pretrained(trained["model_dir"] / "unet").state_dict()
    assert all(torch.equal(value, original[name]) for name, value in saved.items())


def test_resume_none_starts_over(trained, tmp_path, shards_dir, capsys, train_args):
    checkpoint_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoint_dir"], checkpoint_dir)
    train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "1", "--resume", "none"))
    lines = json_lines(capsys.readouterr().out)
    assert [line["step"] for line in lines if "loss" in line] == [1]


def test_training_changes_the_unet_and_the_loss_is_finite(trained):
    trained_unet = UNet2DConditionModel.from_pretrained(trained["model_dir"] / "unet").state_dict()
    initial_unet = load_models("tiny", None, seed=0).unet.state_dict()
    assert any(not torch.equal(value, trained_unet[name]) for name, value in initial_unet.items())
    assert torch.isfinite(torch.tensor(trained["record"]["final_loss"]))


def test_the_training_record_lists_args_steps_loss_and_shards(trained):
    record = json.loads((trained["model_dir"] / "atelier-training.json").read_text())
    assert record == json.loads(json.dumps(trained["record"]))
    assert record["steps"] == 3
    assert record["args"]["batch_size"] == 2
    assert set(record["shards_seen"]) <= {"shard-a.tar", "shard-b.tar"} and record["shards_seen"]


def test_the_saved_pipeline_loads_and_generates_an_image_of_the_model_size(trained):
    pipeline = StableDiffusionPipeline.from_pretrained(trained["model_dir"])
    assert isinstance(pipeline.scheduler, DDIMScheduler)
    assert pipeline.tokenizer.model_max_length == 77
    image = pipeline("a red dog", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert isinstance(image, Image.Image)
    assert image.size == (64, 64)  # tiny: 32x32 latents, VAE downsamples by 2


def test_the_same_seed_trains_the_same_weights(tmp_path, shards_dir, trained, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3", "--checkpoint-every", "2"))
    again = UNet2DConditionModel.from_pretrained(tmp_path / "model" / "unet").state_dict()
    first = UNet2DConditionModel.from_pretrained(trained["model_dir"] / "unet").state_dict()
    assert all(torch.equal(value, first[name]) for name, value in again.items())


def test_v_prediction_is_carried_into_the_saved_scheduler(tmp_path, shards_dir, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--prediction-type", "v_prediction"))
    config = json.loads((tmp_path / "model" / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "v_prediction"


def test_v_prediction_targets_the_velocity():
    # GIVEN a UNet stand-in that predicts zeros, the loss is the mean square of the target
    models = load_models("tiny", None, seed=0)
    models.noise_scheduler.register_to_config(prediction_type="v_prediction")
    batch = {"pixel_values": torch.zeros(1, 3, 16, 16), "caption": ["a dog"]}

    def zero_unet(noisy_latents, timesteps, encoder_hidden_states):
        zero_unet.seen = (noisy_latents, timesteps)
        return type("Output", (), {"sample": torch.zeros_like(noisy_latents)})

    torch.manual_seed(0)
    loss = train.training_loss(zero_unet, models, batch, torch.device("cpu"))
    # WHEN the same draws are replayed by hand
    torch.manual_seed(0)
    latents = models.vae.encode(batch["pixel_values"]).latent_dist.sample() * models.vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (1,))
    velocity = models.noise_scheduler.get_velocity(latents, noise, timesteps)
    # THEN the loss is the velocity's, not the noise's
    assert torch.equal(zero_unet.seen[1], timesteps)
    assert loss.item() == pytest.approx(velocity.pow(2).mean().item(), rel=1e-5)
    assert loss.item() != pytest.approx(noise.pow(2).mean().item(), rel=1e-3)


def test_unknown_model_config_names_the_presets():
    with pytest.raises(ValueError, match="unknown model config 'huge'; presets: sd2, tiny"):
        load_models("huge", None, seed=0)


def test_hyperparameters_in_sm_hps_become_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("SM_HPS", json.dumps({"batch-size": "3", "learning-rate": "0.001", "sagemaker_program": "x"}))
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "train"))
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    args = train.parse_args(["--steps", "7"])
    assert (args.batch_size, args.learning_rate, args.steps) == (3, 0.001, 7)
    assert (args.train_dir, args.model_dir) == (str(tmp_path / "train"), str(tmp_path / "model"))
    assert not hasattr(args, "sagemaker_program")


def test_torchrun_trains_with_one_process_per_shard_and_rank_0_writing(tmp_path, shards_dir):
    # GIVEN two CPU processes under torchrun (gloo), one shard each
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "trainer.train",
        "--train-dir", str(shards_dir), "--model-dir", str(tmp_path / "model"),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2", "--checkpoint-every", "2",
        "--batch-size", "2", "--resolution", "32", "--num-workers", "0", "--log-every", "1",
    ]
    # WHEN they train
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    # THEN one log, one checkpoint holding both ranks' RNG, and both shards in the record
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    assert [line["step"] for line in lines if "loss" in line] == [1, 2]
    assert lines[0]["world_size"] == 2
    checkpoint = tmp_path / "ckpt" / "step-00000002"
    assert sorted(path.name for path in checkpoint.iterdir()) == ["rng-rank0.pt", "rng-rank1.pt", "training_state.pt", "unet"]
    rng = [torch.load(checkpoint / f"rng-rank{rank}.pt")["torch"] for rank in (0, 1)]
    assert not torch.equal(*rng)  # each rank draws its own noise
    record = json.loads((tmp_path / "model" / "atelier-training.json").read_text())
    assert record["shards_seen"] == ["shard-a.tar", "shard-b.tar"]
