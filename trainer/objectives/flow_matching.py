"""The rectified-flow objective of the transformer families (Esser et al., "Scaling Rectified Flow
Transformers for High-Resolution Image Synthesis", 2024: SD3), in the diffusers recipe.

- Noising: x_t = (1 - t) x_0 + t * noise, t in [0, 1] (t = 1 is pure noise); the model predicts the
  velocity noise - x_0, and the loss is its mean squared error. The transformer sees the timestep as
  1000 t, as `FlowMatchEulerDiscreteScheduler` gives it at sampling.
- Timesteps: logit-normal, t = sigmoid(N(mean, std)), drawn by diffusers'
  `compute_density_for_timestep_sampling`, then shifted for the resolution:
  t' = s t / (1 + (s - 1) t) with s = shift_at_reference * (resolution / reference_resolution),
  the paper's shift (its alpha = sqrt(m / n) for m and n pixels: the side ratio). More pixels carry
  more redundant signal at a given noise level, so a larger image needs its timesteps pushed to noise.
- Validation loss, as MLPerf Training's Flux.1 benchmark defines its quality metric: the mean over
  8 equidistant timesteps t = 0, 1/8, ..., 7/8 on held-out samples with fixed noise (no shift).
"""

from dataclasses import dataclass

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling

VALIDATION_TIMESTEPS = tuple(i / 8 for i in range(8))
TIMESTEP_SCALE = 1000  # what the transformer's timestep embedding reads: 1000 t, as the sampler gives it


@dataclass(frozen=True)
class FlowSettings:
    """A preset's flow-matching choices (its `flow` block)."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift_at_reference: float = 1.0
    reference_resolution: int = 256

    @classmethod
    def from_preset(cls, block: dict | None) -> "FlowSettings":
        settings = cls(**(block or {}))
        if settings.logit_std <= 0 or settings.shift_at_reference <= 0 or settings.reference_resolution <= 0:
            raise ValueError(f"flow settings must be positive (logit_std, shift_at_reference, reference_resolution): {block}")
        return settings

    def shift(self, resolution: int) -> float:
        """The timestep shift for square images of this side (or the side of their bucket area)."""
        return self.shift_at_reference * resolution / self.reference_resolution


def shifted(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t pushed towards noise by `shift` (1: unchanged), as FlowMatchEulerDiscreteScheduler shifts its sigmas."""
    return shift * t / (1 + (shift - 1) * t)


def sample_timesteps(settings: FlowSettings, count: int, resolution: int, device: torch.device,
                     generator: torch.Generator) -> torch.Tensor:
    """`count` training timesteps in [0, 1]: logit-normal, shifted for the resolution."""
    u = compute_density_for_timestep_sampling("logit_normal", count, settings.logit_mean, settings.logit_std,
                                              device=generator.device, generator=generator)
    return shifted(u.to(device), settings.shift(resolution))


def noised(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, the velocity target) for latents x_0 at timesteps t in [0, 1]."""
    t = t.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - t) * latents + t * noise, noise - latents
