"""The autoencoder job: train a diffusers `AutoencoderKL` from scratch on image shards, for pipelines
whose base brings no VAE; the encode and training jobs after it take it as their `--vae`.

Runbook
-------
One process (CPU, or one GPU):

    python -m trainer.jobs.autoencoder --train-dir shards/ --validation-dir eval/ --model-dir out/vae \\
        --model-config tiny --resolution 64 --steps 400 --batch-size 16

Data-parallel under torchrun (one process per GPU, or CPU processes over gloo: the container's
`cpu-processes`), each process `--batch-size` images a step from its own share of the shards; rank 0
measures, logs and saves:

    torchrun --standalone --nproc_per_node 2 -m trainer.jobs.autoencoder --train-dir shards/ ...

SageMaker: a training job with the training image and the hyperparameter `task=autoencoder`
(channels: `train`, the manifest's image shards; `validation`, the held-out evaluation shards;
`manifest`, the exclusion list, when there is one). `/opt/ml/model` (the VAE, `autoencoder.json`,
`report.html`) becomes the job's `model.tar.gz`, which the lineage's later jobs receive as the
channel `vae`. A retried job resumes from `/opt/ml/checkpoints`.

The recipe (Rombach et al. 2022, without the adversarial and LPIPS terms, which need pretrained
networks): L1 reconstruction plus `--kl-weight` times the posterior's KL divergence to N(0, I). The
architecture is the `vae` of `--model-config`, so the UNet of the same preset reads its latents.
At the end the latents' moments over the training images set `scaling_factor` (SD's 0.18215 was
measured the same way) and, for a preset whose VAE has a `shift_factor` (the SD3 family's 16-channel
latents, as SD3's and Flux's VAEs define it: latents = (z - shift) * scale), `shift_factor` too, so
the denoiser sees zero-mean, unit-variance latents. Both go into `autoencoder.json`.

Held out: PSNR is measured on the `validation` shards (never trained on), before training (the
random VAE) and after; without them on the training images, and the record says so.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from PIL import Image
from torch.optim.lr_scheduler import LambdaLR

from contracts.recipe_jobs import AutoencoderOptions
from trainer.data.eval_set import find_eval_shards, read_eval_samples
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards, load_exclusions
from trainer.data.phases import plan_from_args
from trainer.jobs.hyperparameters import add_options, checked
from trainer.models.loading import read_preset
from trainer.objectives.numerics import autocast
from trainer.report.write import write_report
from trainer.runtime import distributed
from trainer.runtime.checkpoints import checkpoint_to_resume, load_checkpoint, save_checkpoint
from trainer.runtime.health import log


class RoundTrip(torch.nn.Module):
    """The VAE's encode, posterior sample and decode as one forward: DistributedDataParallel syncs the
    gradients of what a forward ran, and the VAE's own forward does not return the posterior the KL needs."""

    def __init__(self, vae: AutoencoderKL):
        super().__init__()
        self.vae = vae

    def forward(self, pixels: torch.Tensor):
        posterior = self.vae.encode(pixels).latent_dist
        return self.vae.decode(posterior.sample()).sample, posterior


RECORD = "autoencoder.json"
RECONSTRUCTIONS = "reconstructions.png"


def psnr_db(images: torch.Tensor, reconstructions: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of images in [-1, 1], in dB (peak 1 on the [0, 1] scale)."""
    mse = F.mse_loss(reconstructions.float().clamp(-1, 1), images.float()).item() / 4
    return 10 * math.log10(1 / mse) if mse > 0 else float("inf")


@torch.no_grad()
def reconstruct(vae: AutoencoderKL, pixels: torch.Tensor, device: torch.device, batch_size: int = 32) -> torch.Tensor:
    """The posterior means decoded: what the VAE gives back for `pixels` ([N, 3, H, W] in [-1, 1])."""
    out = []
    for start in range(0, len(pixels), batch_size):
        chunk = pixels[start:start + batch_size].to(device, vae.dtype)
        with autocast(device):
            out.append(vae.decode(vae.encode(chunk).latent_dist.mode()).sample.float().cpu())
    return torch.cat(out)


@torch.no_grad()
def latent_moments(vae: AutoencoderKL, batches, device: torch.device, count: int) -> tuple[float, float]:
    """The mean and standard deviation of posterior samples over `count` training batches."""
    values = []
    for _, batch in zip(range(count), batches):
        with autocast(device):
            values.append(vae.encode(batch["pixel_values"].to(device, vae.dtype)).latent_dist.sample().float().flatten())
    values = torch.cat(values)
    return values.mean().item(), values.std().item()


def latent_normalisation(mean: float, std: float, shifts: bool) -> dict:
    """The VAE config's `scaling_factor` (and `shift_factor` where the family's pipeline subtracts one, as
    SD3's and Flux's do: latents = (z - shift) * scale) that give the latents unit variance (and zero mean
    with the shift)."""
    return {"shift_factor": round(mean, 5), "scaling_factor": round(1 / std, 5)} if shifts \
        else {"scaling_factor": round(1 / std, 5)}


def start_near_deterministic(vae: AutoencoderKL, logvar: float) -> None:
    """Start the posterior's log-variance at `logvar` (bias of the layer that outputs it): with the
    default 0 the decoder first sees latents drowned in unit noise and learns the mean picture for
    hundreds of steps; the KL term still shapes the variance from there."""
    layer = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out
    with torch.no_grad():
        layer.bias[vae.config.latent_channels:] = logvar


def cosine_tail(step: int, total: int, floor: float = 0.1) -> float:
    """The learning rate's factor: 1, then a cosine down to `floor` over the last half (steadies the end)."""
    start = total // 2
    if step <= start or total <= start:
        return 1.0
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - start) / (total - start)))


def side_by_side(originals: torch.Tensor, reconstructions: torch.Tensor, count: int = 8, scale: int = 2) -> Image.Image:
    """Originals on the top row, their reconstructions below, each tile scaled up `scale` times."""
    count = min(count, len(originals))
    _, height, width = originals.shape[1:]
    sheet = Image.new("RGB", (count * width, 2 * height), "white")
    for column in range(count):
        for row, tensor in enumerate((originals[column], reconstructions[column])):
            array = ((tensor.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
            sheet.paste(Image.fromarray(array), (column * width, row * height))
    return sheet.resize((sheet.width * scale, sheet.height * scale), Image.Resampling.NEAREST)


def main(args: argparse.Namespace) -> dict:
    """Train, checkpoint, save the VAE and its record; return the record."""
    # setup
    processes = distributed.setup()
    rank, device = processes.rank, processes.device
    model_dir, checkpoint_dir = Path(args.model_dir), Path(args.checkpoint_dir) if args.checkpoint_dir else None
    health_dir = Path(args.output_data_dir) if args.output_data_dir else model_dir / "health"

    # model: the preset's VAE architecture, fresh weights, the same on every rank
    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**read_preset(args.model_config)["vae"])
    start_near_deterministic(vae, args.initial_logvar)
    vae = vae.to(device).train()
    if rank:  # each rank's own posterior noise; rank 0 keeps the stream one process draws
        torch.manual_seed(args.seed + rank)
    round_trip = distributed.wrap(RoundTrip(vae), processes, "ddp")
    size_multiple = 2 ** (len(vae.config.block_out_channels) - 1)
    resolution = args.resolution or vae.config.sample_size
    plan = plan_from_args(None, args.steps, args.batch_size, resolution, args.learning_rate, args.lr_warmup_steps, resolution,
                          size_multiple=size_multiple)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1.0, weight_decay=0.0)
    lr_schedule = LambdaLR(optimizer, lambda steps_done: plan.learning_rate(steps_done + 1)
                           * cosine_tail(steps_done + 1, plan.total_steps))
    step, history = 0, []
    resume_from = checkpoint_to_resume(args.resume, checkpoint_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from, processes, vae, optimizer, lr_schedule, None)
        step, history = state["step"], state["history"]
        log(rank, event="resumed", checkpoint=str(resume_from), step=step)

    # data: this process's share of the training images in batches, and the held-out images
    index = index_shards(args.train_dir, processes.local_rank, processes.local_world_size, load_exclusions(args.manifest),
                         args.index_dir)
    if index.latent:
        raise ValueError(f"{args.train_dir} holds latent shards; an autoencoder trains on images")
    batch_plan = BatchPlan(index.aspect, plan, args.seed, rank, 1, size_multiple, args.aspect_buckets, keys=index.key)
    batches = iter(make_loader(StepBatches(index, batch_plan, step + 1, plan.total_steps, 0.0, args.random_crop, None),
                               args.num_workers))
    eval_shards = find_eval_shards(args.validation_dir) if args.validation_dir else []
    held_out = bool(eval_shards)
    if not held_out:  # no validation channel: the training images, and the record says so
        eval_shards = sorted(Path(path) for path in index.shards)
    samples, _ = read_eval_samples(eval_shards, resolution, args.max_eval_samples)
    if not samples:
        raise ValueError(f"no readable image in {args.validation_dir or args.train_dir} to measure reconstructions on")
    eval_pixels = torch.stack([sample.pixels for sample in samples])
    initial_psnr = psnr_db(eval_pixels, reconstruct(vae, eval_pixels, device)) if step == 0 and rank == 0 else None
    log(rank, event="start", task="autoencoder", step=step, steps=plan.total_steps, samples=len(index),
        held_out_samples=len(samples) if held_out else 0, resolution=resolution, device=str(device),
        world_size=processes.world_size, backend=processes.backend)

    # loop
    started, window_images, window_start = time.perf_counter(), 0, time.perf_counter()
    while step < plan.total_steps:
        step += 1
        pixels = next(batches)["pixel_values"].to(device, non_blocking=True)
        with autocast(device):
            reconstruction, posterior = round_trip(pixels)
        loss_function = F.l1_loss if args.reconstruction_loss == "l1" else F.mse_loss
        reconstruction_loss = loss_function(reconstruction.float(), pixels.float())
        kl = posterior.kl().mean() / pixels[0].numel()  # per pixel value, as the reconstruction term
        loss = reconstruction_loss + args.kl_weight * kl
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(vae.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_schedule.step()
        window_images += len(pixels) * processes.world_size
        if step % args.log_every == 0 or step == plan.total_steps:
            losses = distributed.mean(torch.stack([loss, reconstruction_loss, kl]).detach().float()).tolist()
            if rank == 0:  # the held-out PSNR on rank 0's copy (every rank holds the same weights)
                vae.eval()
                figures = {"step": step, "loss": round(losses[0], 5), "reconstruction": round(losses[1], 5),
                           "kl": round(losses[2], 5),
                           "psnr_db": round(psnr_db(eval_pixels, reconstruct(vae, eval_pixels, device)), 2)}
                vae.train()
                history.append(figures)
            elapsed = time.perf_counter() - window_start
            log(rank, **(figures if rank == 0 else {}), grad_norm=round(grad_norm.item(), 4),
                lr=optimizer.param_groups[0]["lr"], img_per_s=round(window_images / elapsed, 1) if elapsed else None,
                steps=plan.total_steps, eta_s=round((plan.total_steps - step) * elapsed / args.log_every, 1))
            window_images, window_start = 0, time.perf_counter()
        if checkpoint_dir and (step % args.checkpoint_every == 0 or step == plan.total_steps):
            save_checkpoint(checkpoint_dir, processes, vae, optimizer, lr_schedule, None,
                            {"step": step, "history": history}, args.keep_checkpoints)

    if not distributed.replicas_agree(vae):  # a rank that trained apart from the others: its gradients never met
        raise RuntimeError("the ranks' VAE weights differ after training: their gradients were not averaged")
    # The process group ends here, on every rank, DDP's wrapper dropped first: were the wrapper's reducer the
    # group's last holder, the group would end as main returns, with the GIL held, waiting on a gloo thread
    # that needs it (trainer/jobs/train.py's teardown; seen here as a rank that saved and never exited).
    del round_trip
    distributed.barrier()
    distributed.teardown()

    # save (rank 0): the VAE with its measured scaling factor, the record, the reconstructions
    if rank:
        return {}
    vae.eval()
    first_batches = make_loader(StepBatches(index, batch_plan, 1, min(args.scaling_batches, plan.total_steps), 0.0,
                                            args.random_crop, None), 0)
    shifts = "shift_factor" in read_preset(args.model_config)["vae"]  # the family's pipeline subtracts a shift
    vae.register_to_config(**latent_normalisation(*latent_moments(vae, first_batches, device, args.scaling_batches), shifts))
    reconstructions = reconstruct(vae, eval_pixels, device)
    record = {
        "task": "autoencoder", "args": vars(args), "steps": step, "resolution": resolution, "world_size": processes.world_size,
        "psnr_db": round(psnr_db(eval_pixels, reconstructions), 2),
        "psnr_db_initial": None if initial_psnr is None else round(initial_psnr, 2),
        "psnr_db_zeros": round(psnr_db(eval_pixels, torch.zeros_like(eval_pixels)), 2),
        "held_out": held_out, "held_out_samples": len(samples) if held_out else 0, "eval_samples": len(samples),
        "scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.shift_factor,
        "latent_channels": vae.config.latent_channels, "kl_weight": args.kl_weight, "training_samples": len(index),
        "train_s": round(time.perf_counter() - started, 1), "history": history,
    }
    model_dir.mkdir(parents=True, exist_ok=True)
    vae.to("cpu", torch.float32).save_pretrained(model_dir)
    (model_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    health_dir.mkdir(parents=True, exist_ok=True)
    side_by_side(eval_pixels, reconstructions).save(health_dir / RECONSTRUCTIONS)
    write_report(model_dir, health_dir, job=os.environ.get("TRAINING_JOB_NAME"))
    log(rank, event="saved", model_dir=str(model_dir), psnr_db=record["psnr_db"], scaling_factor=record["scaling_factor"])
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Train an AutoencoderKL from scratch on image shards.")
    parser.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                        help="the image shards (default $SM_CHANNEL_TRAIN)")
    parser.add_argument("--index-dir", default=env.get("SM_CHANNEL_INDEXES"),
                        help="the shards' sample tables (default $SM_CHANNEL_INDEXES, else <train-dir>/indexes)")
    parser.add_argument("--validation-dir", default=env.get("SM_CHANNEL_VALIDATION"),
                        help="held-out shards the PSNR is measured on (default $SM_CHANNEL_VALIDATION)")
    parser.add_argument("--manifest", default=env.get("SM_CHANNEL_MANIFEST"),
                        help="the job's manifest JSON or its channel dir: its `exclude` samples are never read")
    parser.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                        help="where the VAE is saved (default $SM_MODEL_DIR)")
    parser.add_argument("--output-data-dir", default=env.get("SM_OUTPUT_DATA_DIR"),
                        help="reconstructions.png (default $SM_OUTPUT_DATA_DIR, else <model-dir>/health)")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints go here (SageMaker: /opt/ml/checkpoints)")
    add_options(parser, AutoencoderOptions)  # the recipe (contracts.recipe_jobs); the paths above are not in it
    return checked(parser, AutoencoderOptions, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
