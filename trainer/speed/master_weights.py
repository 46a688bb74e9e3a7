"""Low-precision (bf16) weights with fp32 master copies held by the optimizer.

Under autocast the UNet keeps fp32 weights and every forward and backward casts them to bf16 again.
`MasterWeights(module)` turns the module's weights bf16 once and keeps an fp32 copy of each, in a
mirror module with the same parameter names (`masters`). The caller gives the masters to
everything that updates the weights: the optimizer (fused AdamW included), gradient clipping, the
finiteness check and the EMA, as trainer.jobs.step's `Trainee.unet`:

    weights = MasterWeights(unet)
    optimizer = weights.track(torch.optim.AdamW(weights.masters.parameters(), fused=True))
    trainee = Trainee(weights.masters, unet, torch.compile(unet), optimizer, schedule,
                      EMA(weights.masters.named_parameters(), 0.9999))

- A post-accumulate-grad hook on each bf16 parameter adds its gradient into the master's fp32
  `.grad` and frees the bf16 one, so micro-batches of gradient accumulation sum in fp32 and
  clipping sees fp32 gradients.
- `track(optimizer)` adds a post-step hook that copies the stepped masters into the bf16 weights:
  an update too small for bf16 to represent accumulates in the master until it shows.
- Floating-point inputs to the module are cast to bf16 (FSDP's `cast_forward_inputs`), so it also
  runs without autocast (on a CPU, where trainer.objectives.numerics' autocast is off).
- `restore()` puts fp32 weights holding the masters' values back and removes the hooks.

Single process only: DDP reduces into `.grad` from hooks of its own, and FSDP2 has its own mixed
precision policy for this.
"""

from __future__ import annotations

import torch


def mirror(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Empty modules in `module`'s tree, holding `dtype` copies of its parameters under the same names."""
    copies: dict[int, torch.nn.Parameter] = {}  # a parameter shared by two modules gets one master

    def build(source: torch.nn.Module) -> torch.nn.Module:
        node = torch.nn.Module()
        for name, param in source.named_parameters(recurse=False):
            if id(param) not in copies:
                copies[id(param)] = torch.nn.Parameter(param.detach().to(dtype, copy=True),
                                                       requires_grad=param.requires_grad)
            node.register_parameter(name, copies[id(param)])
        for name, child in source.named_children():
            node.add_module(name, build(child))
        return node

    return build(module)


class MasterWeights:
    """`module`'s weights in `dtype` (bf16), their fp32 masters in `masters`; see the module docstring."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, cast_inputs: bool = True):
        self.module, self.dtype = module, dtype
        self.masters = mirror(module, torch.float32)
        module.to(dtype)  # in place: the parameter objects stay, so hooks and callers keep them
        weights = dict(module.named_parameters())
        self.pairs = [(weights[name], master) for name, master in self.masters.named_parameters()]
        self.handles = [weight.register_post_accumulate_grad_hook(self.grad_mover(master))
                        for weight, master in self.pairs if weight.requires_grad]
        if cast_inputs:
            self.handles.append(module.register_forward_pre_hook(self.cast_inputs, with_kwargs=True))

    @staticmethod
    def grad_mover(master: torch.nn.Parameter):
        """The hook that moves a weight's fresh bf16 gradient into `master.grad` (fp32), summing micro-batches."""
        def move(weight: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = weight.grad.to(torch.float32)
            else:
                master.grad.add_(weight.grad)
            weight.grad = None
        return move

    def cast_inputs(self, module, args: tuple, kwargs: dict):
        def cast(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(self.dtype)
            if isinstance(value, dict):
                return {key: cast(item) for key, item in value.items()}
            return value
        return tuple(cast(arg) for arg in args), {key: cast(value) for key, value in kwargs.items()}

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` (over `masters`), its every step followed by a copy of the masters into the weights."""
        self.handles.append(optimizer.register_step_post_hook(lambda *_: self.copy_to_weights()))
        return optimizer

    @torch.no_grad()
    def copy_to_weights(self) -> None:
        weights, masters = zip(*self.pairs)
        torch._foreach_copy_(list(weights), list(masters))

    @torch.no_grad()
    def restore(self) -> None:
        """The module back in fp32, holding the masters' values exactly; no hooks left."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.module.to(torch.float32)
        self.copy_to_weights()
        for weight, master in self.pairs:
            weight.grad, master.grad = None, None
