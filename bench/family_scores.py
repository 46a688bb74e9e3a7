"""Scoring for bench/family_ttt.py: one held-out loss both families are measured by, and the catalogue grid.

**The loss.** MLPerf Flux.1's validation loss (trainer/jobs/scoring.py `flow_validation_losses`): the squared
error of the velocity `noise - latents` at 8 flow times, each sample's noise fixed by (seed, sample, timestep).
A UNet of the DDPM family is scored by the same quantity: its noisy input at flow time t is the DDPM state with
the same signal-to-noise ratio, x_tau = alpha x0 + sigma eps with sigma / (alpha + sigma) = t (the flow state
times alpha + sigma), and its prediction (epsilon or v) is turned into the velocity it implies, eps_hat - x0_hat.
The 8 times are those of the UNet schedule's timesteps nearest to MLPerf's t = 0, 1/8, ..., 7/8 (`common_times`),
and both families are scored at them: the flow model at t = 0 has no noise in its input and the velocity's noise
half cannot be predicted (a loss >= 1 whatever it learned), while the DDPM UNet's least noisy state is t = 0.028,
from which it can; at MLPerf's own times the t = 0 term alone would decide the comparison. Same latents (one
VAE), same noise, same target, same signal-to-noise ratios: the two families' numbers are one measure.

**The grid.** Every shape x foreground x background of the catalogue (atelier/prompt_match.py GRID_PROMPTS),
each drawn with GRID_SEEDS as the endpoint draws a request (trainer/serve/generation.py, the saved
pipeline's own sampler, STEPS steps, GUIDANCE), scored on colours and shape (`matches_grid`):
`demo.prompt_match_grid`'s measure. One pipeline call per seed, every prompt in it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.data.eval_set import EvalSample
from trainer.jobs.scoring import draw_seed, flow_validation_losses, load_models
from trainer.models.bundle import Models
from trainer.models.text import encode_captions
from trainer.objectives.flow_matching import VALIDATION_TIMESTEPS


def flow_times(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Each DDPM timestep's flow time: sigma / (alpha + sigma), the same signal-to-noise ratio."""
    alpha, sigma = alphas_cumprod.double().sqrt(), (1 - alphas_cumprod.double()).sqrt()
    return sigma / (alpha + sigma)


def ddpm_timesteps(alphas_cumprod: torch.Tensor, times: tuple[float, ...]) -> list[int]:
    """The DDPM training timestep whose state has each flow time's signal-to-noise ratio (nearest)."""
    equivalent = flow_times(alphas_cumprod)
    return [int((equivalent - t).abs().argmin()) for t in times]


def common_times(unet_base: Path) -> tuple[float, ...]:
    """The flow times both families are scored at: those of the UNet base's timesteps nearest MLPerf's 8."""
    from diffusers import DDPMScheduler
    cumprod = DDPMScheduler.from_pretrained(unet_base, subfolder="scheduler").alphas_cumprod
    equivalent = flow_times(cumprod)
    return tuple(round(float(equivalent[step]), 6) for step in ddpm_timesteps(cumprod, VALIDATION_TIMESTEPS))


@torch.no_grad()
def unet_velocity_losses(models: Models, samples: list[EvalSample], seed: int, device: torch.device,
                         times: tuple[float, ...]) -> torch.Tensor:
    """[samples, len(times)] squared errors of the velocity a DDPM UNet's prediction implies, at the flow times'
    equivalent timesteps, with the noise `flow_validation_losses` draws."""
    scheduler = models.noise_scheduler
    cumprod = scheduler.alphas_cumprod.to(device)
    steps = ddpm_timesteps(scheduler.alphas_cumprod, times)
    timesteps = torch.tensor(steps, dtype=torch.long, device=device)
    alpha, sigma = cumprod[timesteps].sqrt().view(-1, 1, 1, 1), (1 - cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
    count = len(steps)
    losses = torch.empty(len(samples), count, dtype=torch.float64)
    for number, sample in enumerate(samples):
        latents = models.vae.encode(sample.pixels[None].to(device)).latent_dist.mean * models.vae.config.scaling_factor
        latents = latents.repeat(count, 1, 1, 1)
        noise = torch.stack([torch.randn(latents.shape[1:], generator=torch.Generator("cpu").manual_seed(
            draw_seed(seed, number, index))) for index in range(count)]).to(device)
        noisy = alpha * latents + sigma * noise
        context, _ = encode_captions(models, [sample.caption], device)
        output = models.denoiser(noisy, timesteps, context.repeat_interleave(count, dim=0)).sample
        velocity = implied_velocity(output, noisy, alpha, sigma, scheduler.config.prediction_type)
        losses[number] = F.mse_loss(velocity, noise - latents, reduction="none").mean(dim=(1, 2, 3)).double().cpu()
    return losses


def implied_velocity(output: torch.Tensor, noisy: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
                     prediction_type: str) -> torch.Tensor:
    """The flow velocity eps_hat - x0_hat a DDPM prediction at x_tau = alpha x0 + sigma eps implies."""
    if prediction_type == "v_prediction":  # v = alpha eps - sigma x0
        return (sigma * noisy + alpha * output) - (alpha * noisy - sigma * output)
    if prediction_type == "epsilon":
        return output - (noisy - sigma * output) / alpha.clamp(min=1e-4)
    raise ValueError(f"no velocity for prediction type {prediction_type!r}")


def velocity_loss(pipeline: Path, samples: list[EvalSample], seed: int, device: torch.device,
                  times: tuple[float, ...]) -> dict:
    """The held-out velocity loss of the pipeline's model at `times` (mean and by flow time)."""
    models = load_models(pipeline, device)
    losses = (flow_validation_losses(models, samples, seed, device, times) if models.family is not None
              else unet_velocity_losses(models, samples, seed, device, times))
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"val_loss": losses.mean().item(),
            "by_t": {f"{t:.4g}": round(losses[:, i].mean().item(), 5) for i, t in enumerate(times)}}


def grid_match(pipeline: Path) -> dict:
    """The share of the catalogue grid drawn with its colours and shape, and the misses by prompt."""
    from atelier.prompt_match import GRID_PROMPTS, GRID_SEEDS, GUIDANCE, STEPS, matches_grid
    from trainer.serve.generation import generate_batch, load_pipeline
    from trainer.serve.protocol import parse_request
    from trainer.serve.settings import ServeSettings
    settings = ServeSettings(compile="off", cuda_graphs=False, max_batch=len(GRID_PROMPTS))
    loaded = load_pipeline(pipeline, settings)
    hits: dict[str, int] = {}
    for seed in GRID_SEEDS:
        requests = [parse_request(json.dumps({"prompt": prompt, "seed": seed, "num_inference_steps": STEPS,
                                              "guidance_scale": GUIDANCE}).encode(), settings) for prompt in GRID_PROMPTS]
        for prompt, images in zip(GRID_PROMPTS, generate_batch(loaded, requests)):
            png = io.BytesIO()
            images[0].save(png, format="PNG")
            hits[prompt] = hits.get(prompt, 0) + matches_grid(prompt, png.getvalue())
    del loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    drawn = len(GRID_PROMPTS) * len(GRID_SEEDS)
    return {"grid": round(sum(hits.values()) / drawn, 4), "grid_missed": sorted(p for p, n in hits.items() if n < len(GRID_SEEDS))}
