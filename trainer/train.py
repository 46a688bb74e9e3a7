"""Train a latent-diffusion UNet on Atelier shards; save a diffusers StableDiffusionPipeline.

Runbook
-------
One process (CPU, or one GPU when there is one):

    python -m trainer.train --train-dir shards/ --model-dir out/model \\
        --checkpoint-dir out/checkpoints --steps 200 --model-config tiny

One host, N GPUs (DDP; rank 0 alone logs and writes):

    torchrun --nproc_per_node N -m trainer.train <the same arguments>

SageMaker: the image's entrypoint (`python -m trainer.container train`, trainer/container.py) turns
the job's hyperparameters into these arguments, passes `--checkpoint-dir /opt/ml/checkpoints`
(synced to S3 by CheckpointConfig) and uses torchrun when the instance has several GPUs.
`--train-dir` and `--model-dir` default to $SM_CHANNEL_TRAIN and $SM_MODEL_DIR; $SM_HPS, when set,
supplies the other defaults.

Resuming: `--resume latest` (the default) continues from the checkpoint that
`<checkpoint-dir>/latest` names, if there is one: a retried job whose checkpoints SageMaker restored
picks up where it stopped. `--resume none` starts over; `--resume <checkpoint dir>` picks one.
The data stream restarts (reshuffled with the resumed step) rather than at the exact sample.

Checkpoints (every --checkpoint-every steps and at the last step, the newest two kept):

    <checkpoint-dir>/step-00000200/unet/              UNet2DConditionModel.save_pretrained
    <checkpoint-dir>/step-00000200/training_state.pt  step, args, optimizer, loss, shards seen
    <checkpoint-dir>/step-00000200/rng-rank<r>.pt     each rank's torch/cuda/python RNG states
    <checkpoint-dir>/latest                           "step-00000200", written last

Output: `<model-dir>` holds the pipeline (`StableDiffusionPipeline.from_pretrained(model_dir)`)
and `atelier-training.json` (args, steps, final loss, shards seen). Logs: a JSON line per
--log-every steps on stdout.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from torch.nn.parallel import DistributedDataParallel

from trainer.data import make_loader
from trainer.models import Models, load_models

KEEP_CHECKPOINTS = 2  # the newest, and the one before in case the newest was cut off mid-upload


# ---------------------------------------------------------------- setup


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): one process per GPU under torchrun, else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return int(os.environ.get("RANK", 0)), world_size, device


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def autocast(device: torch.device):
    """bf16 autocast on GPUs (weights stay fp32); full precision on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def log(rank: int, **fields) -> None:
    """One JSON line on stdout, from rank 0 only."""
    if rank == 0:
        print(json.dumps(fields), flush=True)


# ---------------------------------------------------------------- the loss


def training_loss(unet, models: Models, batch: dict, device: torch.device) -> torch.Tensor:
    """The diffusion objective: noise the image latents at random timesteps, predict the target."""
    scheduler = models.noise_scheduler
    pixel_values = batch["pixel_values"].to(device, non_blocking=True)
    input_ids = models.tokenizer(
        batch["caption"],
        padding="max_length",
        max_length=models.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids.to(device)
    with torch.no_grad(), autocast(device):
        latents = models.vae.encode(pixel_values).latent_dist.sample().float()
        latents = latents * models.vae.config.scaling_factor  # the unit variance the UNet expects
        encoder_hidden_states = models.text_encoder(input_ids)[0]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    if scheduler.config.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    with autocast(device):
        prediction = unet(noisy_latents, timesteps, encoder_hidden_states).sample
    return F.mse_loss(prediction.float(), target.float())


# ---------------------------------------------------------------- checkpoints


def rng_states() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])


def gather_shards(seen: set[str]) -> list[str]:
    """Names of the shards any rank has read so far."""
    if not dist.is_initialized():
        return sorted(seen)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return sorted(set().union(*everyone))


def save_checkpoint(checkpoint_dir: Path, rank: int, state: dict, unet, optimizer) -> None:
    """Write step-N/ under a temporary name, rename it, then point `latest` at it.

    A job killed at any moment leaves `latest` naming a complete checkpoint (or no `latest`).
    """
    name = f"step-{state['step']:08d}"
    tmp, final = checkpoint_dir / f".tmp-{name}", checkpoint_dir / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_states(), tmp / f"rng-rank{rank}.pt")  # every rank draws its own noise
    if rank == 0:
        unet.save_pretrained(tmp / "unet")
        torch.save({**state, "optimizer": optimizer.state_dict()}, tmp / "training_state.pt")
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_atomically(checkpoint_dir / "latest", name)
        prune_checkpoints(checkpoint_dir)
    barrier()


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prune_checkpoints(checkpoint_dir: Path) -> None:
    """Delete all but the newest KEEP_CHECKPOINTS step directories."""
    for old in sorted(checkpoint_dir.glob("step-*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)


def checkpoint_to_resume(resume: str, checkpoint_dir: Path | None) -> Path | None:
    """The checkpoint directory `--resume` asks for, or None to start from step 0."""
    if resume == "none":
        return None
    if resume != "latest":
        return Path(resume)
    marker = checkpoint_dir / "latest" if checkpoint_dir else None
    if marker is None or not marker.is_file():
        return None
    return checkpoint_dir / marker.read_text().strip()


def load_checkpoint(path: Path, rank: int, unet, optimizer) -> dict:
    """Put the saved UNet weights, optimizer and RNG states back; return the training state."""
    saved_unet = UNet2DConditionModel.from_pretrained(path / "unet")
    unet.load_state_dict(saved_unet.state_dict())
    state = torch.load(path / "training_state.pt", map_location="cpu")
    optimizer.load_state_dict(state.pop("optimizer"))
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than saved
        restore_rng_states(torch.load(rng_file))
    return state


# ---------------------------------------------------------------- output


def save_pipeline(models: Models, model_dir: Path) -> None:
    """The trained UNet with the frozen parts as a StableDiffusionPipeline, ready to serve."""
    pipeline = StableDiffusionPipeline(
        vae=models.vae,
        text_encoder=models.text_encoder,
        tokenizer=models.tokenizer,
        unet=models.unet,
        # DDIM samples well in few steps and reads the training noise schedule as it is.
        scheduler=DDIMScheduler.from_config(models.noise_scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(model_dir)


def default_resolution(models: Models) -> int:
    """The image size the model was built for: latent sample size times the VAE's downsampling."""
    return models.unet.config.sample_size * 2 ** (len(models.vae.config.block_out_channels) - 1)


# ---------------------------------------------------------------- main


def main(args: argparse.Namespace) -> dict:
    """Train, checkpoint, save the pipeline; return what atelier-training.json records."""
    # setup
    rank, world_size, device = setup_distributed()
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None

    # models: the same initial weights on every rank, then each rank draws its own noise
    models = load_models(args.model_config, args.pretrained, args.seed)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    if args.prediction_type:
        models.noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    models.vae.to(device)
    models.text_encoder.to(device)
    unet = models.unet.to(device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate)
    step, last_loss, shards_seen = 0, None, set()
    resume_from = checkpoint_to_resume(args.resume, checkpoint_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from, rank, unet, optimizer)
        step, last_loss, shards_seen = state["step"], state["loss"], set(state["shards_seen"])
        log(rank, event="resumed", checkpoint=str(resume_from), step=step)
    model = unet
    if world_size > 1:
        model = DistributedDataParallel(unet, device_ids=[device.index] if device.type == "cuda" else None)

    # data: reseeded by the step so a resumed run does not replay the samples it began with
    resolution = args.resolution or default_resolution(models)
    batches = iter(make_loader(args.train_dir, resolution, args.batch_size, args.seed + step, args.num_workers))

    # loop
    log(rank, event="start", step=step, steps=args.steps, world_size=world_size, device=str(device), resolution=resolution)
    window_start, window_images = time.perf_counter(), 0
    while step < args.steps:
        batch = next(batches)
        loss = training_loss(model, models, batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        shards_seen.update(batch["shard"])
        window_images += len(batch["caption"]) * world_size
        if step % args.log_every == 0 or step == args.steps:
            last_loss = loss.item()
            elapsed = time.perf_counter() - window_start
            log(rank, step=step, loss=round(last_loss, 6), img_per_s=round(window_images / elapsed, 2))
            window_start, window_images = time.perf_counter(), 0
        if checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
            state = {"step": step, "args": vars(args), "loss": loss.item(), "shards_seen": gather_shards(shards_seen)}
            save_checkpoint(checkpoint_dir, rank, state, unet, optimizer)
            log(rank, event="checkpoint", step=step, dir=str(checkpoint_dir / f"step-{step:08d}"))

    # save
    record = {"args": vars(args), "steps": step, "final_loss": last_loss, "shards_seen": gather_shards(shards_seen)}
    if rank == 0:
        model_dir = Path(args.model_dir)
        save_pipeline(models, model_dir)
        (model_dir / "atelier-training.json").write_text(json.dumps(record, indent=2) + "\n")
        log(rank, event="saved", model_dir=str(model_dir), steps=step, final_loss=last_loss)
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Train a latent-diffusion UNet on Atelier shards.")
    parser.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                        help="directory with the *.tar shards, at any depth (default $SM_CHANNEL_TRAIN)")
    parser.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                        help="where the pipeline is saved (default $SM_MODEL_DIR)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoints go here; none are written without it (SageMaker: /opt/ml/checkpoints)")
    parser.add_argument("--resume", default="latest", help="'latest' (if any), 'none', or a checkpoint directory")
    parser.add_argument("--model-config", default="tiny", help="a preset in trainer/configs/ (without .json)")
    parser.add_argument("--pretrained", default=None, help="a local diffusers pipeline directory to start from")
    parser.add_argument("--prediction-type", default=None, choices=["epsilon", "v_prediction"],
                        help="the UNet's target (default: the scheduler's)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps in total, counting resumed ones")
    parser.add_argument("--batch-size", type=int, default=4, help="images per step per process")
    parser.add_argument("--resolution", type=int, default=None, help="square image size (default: the model's)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader processes per training process")
    # Inside a SageMaker training-toolkit image the hyperparameters arrive as SM_HPS, all strings;
    # argparse converts string defaults with each argument's type.
    hyperparameters = json.loads(env.get("SM_HPS", "{}"))
    parser.set_defaults(**{
        name.replace("-", "_"): str(value)
        for name, value in hyperparameters.items()
        if not name.startswith("sagemaker_")  # the SageMaker SDK's own settings, not ours
    })
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
