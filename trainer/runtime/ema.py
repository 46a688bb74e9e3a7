"""An exponential moving average of the UNet's weights, the weights diffusion models are sampled with.

After update n the decay is min(decay, (1 + n) / (10 + n)), the warm-up diffusers' EMAModel uses:
early on the average follows the weights closely instead of remembering the random init. The
shadow weights are fp32 tensors shaped like the parameters (under FSDP, like their local shards).
"""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class EMA:
    def __init__(self, named_parameters, decay: float):
        self.decay = decay
        self.updates = 0
        self.shadow = {name: param.detach().clone().float() for name, param in named_parameters}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, named_parameters) -> None:
        """Move the average toward the current weights (call after each optimizer step)."""
        self.updates += 1
        weight = 1 - self.current_decay()
        shadows, params = zip(*((self.shadow[name], param.detach().float()) for name, param in named_parameters))
        torch._foreach_lerp_(list(shadows), list(params), weight)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates}

    def load_state_dict(self, state: dict, weights: dict[str, torch.Tensor]) -> None:
        """The update count from a checkpoint's training state, the weights from its ema_unet/; the decay stays
        this run's (`--ema-decay`), as the learning rate follows this job's schedule."""
        self.updates = state["updates"]
        for name, shadow in self.shadow.items():
            full = weights[name].to(shadow.device)
            if isinstance(shadow, DTensor):  # FSDP: keep this rank's shard of the full tensor
                full = distribute_tensor(full, shadow.device_mesh, shadow.placements)
            shadow.copy_(full)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The averaged weights as whole CPU tensors (under FSDP a collective: every rank calls it)."""
        return {
            name: (shadow.full_tensor() if isinstance(shadow, DTensor) else shadow).detach().cpu()
            for name, shadow in self.shadow.items()
        }
