"""The UNet's (or a transformer family's) forward, loss and backward replayed from a CUDA graph, one graph per
input shape.

Why: a small UNet at a small resolution is bound by the host, not the GPU. Its step is thousands of
kernels of a few microseconds each, and Python launches them one at a time; a graph replays them all
with one launch (bench/RESULTS.md, "CUDA graphs on the small preset").

What stays outside the graph, so a step computes what the eager step computes:
- every random draw (trainer/objectives/diffusion.py `noised_inputs`, from the step's seeded generator) and the
  text encoders: they run eagerly and are copied into the graph's static inputs;
- gradient clipping, the finiteness check, AdamW, the EMA and the schedule (trainer/jobs/step.py).

How (torch's "CUDA Graphs" notes): the first `warmup` calls of a shape run eagerly on a side stream,
the next one captures the graph and replays it. Both run autocast without its weight cache, as a capture
must (a compiled step guards on that switch: a change compiles it again). The capture checks only its
own thread's calls: the loader's pin-memory thread keeps working through it. The gradients
are allocated by the first eager call, then only zeroed in place by the step, and every replay adds
into them, so graphs of several shapes (aspect buckets, progressive phases) and gradient accumulation
share them, and the graphs share one memory pool.

Only for one process on a CUDA device: DDP's all-reduce hooks and FSDP's resharding are not captured
here (`usable` says why not).
"""

from __future__ import annotations

import dataclasses

import torch

from trainer.objectives.diffusion import Noised, prediction_loss


def usable(device: torch.device, world_size: int) -> str | None:
    """None when CUDA graphs can run here, else the reason they cannot."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if world_size != 1:
        return "CUDA graphs run in a single process (the gradient all-reduce is not captured)"
    return None


def shape_of(noised: Noised) -> tuple:
    """What a graph is specialised to: every input's shape and dtype."""
    return tuple((tuple(tensor.shape), tensor.dtype) for tensor in _tensors(noised))


def _tensors(noised: Noised) -> list[torch.Tensor]:
    """The inputs a graph reads, in a fixed order (a transformer family's context is `noised.context`)."""
    tensors = [noised.noisy_latents, noised.timesteps, noised.context, noised.target]
    if noised.weights is not None:
        tensors.append(noised.weights)
    for name in sorted(noised.added_conditions or {}):
        tensors.append(noised.added_conditions[name])
    if noised.conditioning is not None:
        tensors += [part for part in (noised.conditioning.pooled, noised.conditioning.mask) if part is not None]
    return tensors


def _rebuilt(noised: Noised, tensors: list[torch.Tensor]) -> Noised:
    """`noised` with its tensors replaced, in _tensors' order."""
    noisy_latents, timesteps, context, target, *rest = tensors
    weights = rest.pop(0) if noised.weights is not None else None
    added = {name: rest.pop(0) for name in sorted(noised.added_conditions)} if noised.added_conditions else None
    conditioning = None
    if noised.conditioning is not None:
        pooled = rest.pop(0) if noised.conditioning.pooled is not None else None
        mask = rest.pop(0) if noised.conditioning.mask is not None else None
        conditioning = dataclasses.replace(noised.conditioning, context=context, pooled=pooled, mask=mask)
    return Noised(noisy_latents, timesteps, context, target, weights, added, conditioning)


class _Graph:
    """One captured forward + loss + backward and its static inputs and output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], loss: torch.Tensor):
        self.graph, self.inputs, self.loss = graph, inputs, loss

    def replay(self, noised: Noised) -> torch.Tensor:
        for static, tensor in zip(self.inputs, _tensors(noised)):
            static.copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites the static output


class GraphedBackward:
    """`loss_and_backward(noised, scale)`: the loss of `step_model` on `noised`, its gradient times
    `scale` added to the parameters' gradients; from a CUDA graph once the shape has warmed up."""

    def __init__(self, step_model: torch.nn.Module, parameters: list[torch.nn.Parameter], warmup: int = 2):
        if warmup < 1:
            raise ValueError("CUDA graphs need at least one eager warm-up call: it allocates the gradients")
        self.step_model, self.warmup, self.parameters = step_model, warmup, list(parameters)
        self.stream = torch.cuda.Stream()
        self.graphs: dict[tuple, _Graph] = {}
        self.warm: dict[tuple, int] = {}  # shape -> eager calls made
        self.pool = None  # one memory pool for every graph (replays never overlap)

    def zero_grad(self) -> None:
        """Gradients to zero in place, never to None: the graphs add into these tensors. A parameter
        no backward reaches keeps None, so AdamW passes it over as it does in an eager step."""
        torch._foreach_zero_([parameter.grad for parameter in self.parameters if parameter.grad is not None])

    def loss_and_backward(self, noised: Noised, scale: float) -> torch.Tensor:
        key = (shape_of(noised), scale)
        if key in self.graphs:
            return self.graphs[key].replay(noised)
        if self.warm.get(key, 0) < self.warmup:
            self.warm[key] = self.warm.get(key, 0) + 1
            return self._eager_on_side_stream(noised, scale)
        self.graphs[key] = self._capture(noised, scale)
        return self.graphs[key].replay(noised)

    def _eager_on_side_stream(self, noised: Noised, scale: float) -> torch.Tensor:
        """A warm-up call: eager, off the default stream and ordered with it both ways (torch's notes)."""
        default = torch.cuda.current_stream()
        self.stream.wait_stream(default)
        with torch.cuda.stream(self.stream):
            # autocast's weight cache off, as in the capture: a compiled step_model's guards include that
            # switch, and a change would compile the whole step a second time at the capture
            loss = prediction_loss(self.step_model, noised, autocast_cache=False)
            (loss * scale).backward()
            loss = loss.detach()
        default.wait_stream(self.stream)
        loss.record_stream(default)  # read there next; its memory is not reused before
        return loss

    def _capture(self, noised: Noised, scale: float) -> _Graph:
        inputs = [tensor.clone() for tensor in _tensors(noised)]
        graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread allocates pinned memory meanwhile, which in the
        # default (global) mode invalidates the capture; nothing of that thread's runs on this stream
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            loss = prediction_loss(self.step_model, _rebuilt(noised, inputs), autocast_cache=False)
            (loss * scale).backward()
        self.pool = graph.pool()
        return _Graph(graph, inputs, loss.detach())
