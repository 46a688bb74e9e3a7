"""The model server's speed levers (trainer/serve/settings.py's ServeSettings) and its generation thread.

bench/serve_gpu.py measures each lever alone against the plain server (every lever off) and the
server as configured against diffusers' own pipeline (bench/RESULTS.md). On by default, on a GPU:

- $SERVE_COMPILE=default (off|default|max-autotune): torch.compile of the UNet (or a transformer family's transformer) and the VAE decoder
  (Inductor; max-autotune benchmarks kernel choices while compiling). On a CPU (the local stack's
  tiny model) nothing compiles: Inductor costs minutes there and gains nothing.
- $SERVE_CUDA_GRAPHS=1: the compiled UNet and decoder replayed as CUDA graphs (one launch per call,
  none of eager PyTorch's per-kernel CPU work, which bounds a 512 px image at batch 1): torch.compile
  mode "reduce-overhead" (or "max-autotune" with $SERVE_COMPILE=max-autotune); nothing without compile.

Off by default:
- $SERVE_SCHEDULER=dpmpp: DPM-Solver++ (2M) from the saved scheduler's noise schedule in place of
  the saved one (DDIM): as good in fewer steps, but a request still sets its steps, and the same
  request would give another image.
- $SERVE_FUSE_QKV=1: the attention blocks' query/key/value projections fused into one matmul
  (key/value for cross-attention), in the UNet and the VAE (diffusers' fuse_qkv_projections).
- $SERVE_CHANNELS_LAST=1: the UNet's and the VAE's weights in channels-last layout.
- $SERVE_BATCH_WINDOW_MS=N: requests arriving within N ms of the first waiting one that ask the same
  steps, guidance and size run as one pipeline call of up to $SERVE_MAX_BATCH images (Batcher).

A compiled model compiles per input shape. The server compiles the shapes of $SERVE_WARMUP_IMAGES
(images per request, at the model's size and default guidance) before /ping answers 200, then runs
any other shape eagerly (torch.compiler.set_stance("eager_on_recompile")): a request never waits
minutes for Inductor, which SageMaker's 60 s invocation timeout would turn into an error.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from contracts.serve_environment import COMPILE_MODES, SCHEDULERS  # the settings' choices, a contract
from trainer.models.families import guides_by_negative

NO_CUDA = "skipped: no CUDA device (compile and CUDA graphs are for the GPU endpoint)"


def inductor_mode(compile_mode: str, cuda_graphs: bool) -> str | None:
    """torch.compile's mode for $SERVE_COMPILE and $SERVE_CUDA_GRAPHS; None when nothing compiles."""
    if compile_mode == "max-autotune":
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    if compile_mode == "default":
        return "reduce-overhead" if cuda_graphs else "default"
    return None  # off: CUDA graphs come through torch.compile, so none either


def lever_plan(settings, cuda: bool) -> dict:
    """What load_pipeline applies for these settings on this device; `compile` says why when skipped."""
    mode = inductor_mode(settings.compile, settings.cuda_graphs)
    return {
        "scheduler": settings.scheduler,
        "fuse_qkv": settings.fuse_qkv,
        "channels_last": settings.channels_last,
        "compile": (mode if cuda else NO_CUDA) if mode else "off",
        "batch_window_ms": settings.batch_window_ms,
    }


def compiled(plan: dict) -> bool:
    return plan["compile"] not in ("off", NO_CUDA)


def denoiser_of(pipeline: DiffusionPipeline) -> torch.nn.Module:
    """The pipeline's UNet, or its transformer (the SD3, Flux and PixArt families)."""
    return pipeline.unet if hasattr(pipeline, "unet") else pipeline.transformer


def flow_sampler(pipeline: DiffusionPipeline) -> bool:
    """Whether the saved sampler integrates a flow-matching model (its noise schedule is not a DDPM one)."""
    config = pipeline.scheduler.config
    return isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler) or bool(config.get("use_flow_sigmas"))


def apply_levers(pipeline: DiffusionPipeline, plan: dict) -> None:
    """The plan's levers on a loaded pipeline, in place (the same modules and weights)."""
    if plan["scheduler"] == "dpmpp" and not flow_sampler(pipeline):  # a flow model keeps its flow sampler
        pipeline.scheduler = DPMSolverMultistepScheduler.from_config(
            pipeline.scheduler.config, algorithm_type="dpmsolver++", solver_order=2)
    if plan["fuse_qkv"]:
        if hasattr(pipeline, "fuse_qkv_projections"):
            pipeline.fuse_qkv_projections()
        else:  # the SD3 and PixArt pipelines have none: their transformer and VAE fuse their own
            denoiser_of(pipeline).fuse_qkv_projections()
            pipeline.vae.fuse_qkv_projections()
    denoiser = denoiser_of(pipeline)
    if plan["channels_last"]:
        denoiser.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    if compiled(plan):
        # One graph per shape (dynamic=False): the shapes are few and known (warm-up), and static
        # shapes are what max-autotune and CUDA graphs need.
        denoiser.compile(mode=denoiser_mode(pipeline, plan["compile"]), fullgraph=True, dynamic=False)
        pipeline.vae.decoder.compile(mode=plan["compile"], fullgraph=True, dynamic=False)


def denoiser_mode(pipeline: DiffusionPipeline, mode: str) -> str:
    """The denoiser's compile mode: the plan's, without CUDA graphs where the pipeline may call it twice a step
    (true CFG: a Flux without guidance embeddings, unasked where it learned an unconditional prediction, else for
    a request with a negative prompt). Each call into a graphed function starts a new generation of Inductor's
    graph trees, whose outputs overwrite the previous call's before the pipeline combines the two."""
    if not guides_by_negative(pipeline):
        return mode
    return {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)


# ---------------------------------------------------------------- the generation thread


class Batcher:
    """Runs every generation on one thread, one request a call, or with a window (`window_s` > 0)
    the requests that arrive within it of the first waiting one and share its `key` (steps,
    guidance, size) as one call of at most `max_images` images.

    One thread, not one per HTTP request: CUDA graphs recorded by torch.compile belong to the thread
    that recorded them (Inductor keeps its graph trees in thread-local storage), so a new thread per
    request would record them again on every request; the server's main thread loads, warms up and
    then runs `serve` itself (`start=False`). `run(generations)` returns each one's images; a request
    that does not fit waits for the next call, in arrival order.
    """

    def __init__(self, run: Callable[[list], list[list]], key: Callable, window_s: float, max_images: int,
                 start: bool = True):
        self.run, self.key, self.window_s, self.max_images = run, key, window_s, max_images
        self.pending: deque[tuple[object, Future]] = deque()
        self.ready = threading.Condition()
        self.closed = False
        if start:
            threading.Thread(target=self.serve, name="generation", daemon=True).start()

    def submit(self, generation) -> list:
        """The generation's images, once the call that holds it has run (its exception, if it failed)."""
        done: Future = Future()
        with self.ready:
            self.pending.append((generation, done))
            self.ready.notify_all()
        return done.result()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()

    def serve(self) -> None:
        """Run calls until closed."""
        while (batch := self.next_batch()) is not None:
            try:
                results = self.run([generation for generation, _ in batch])
            except Exception as error:  # every request of the call reports it; the thread keeps serving
                for _, done in batch:
                    done.set_exception(error)
                continue
            for (_, done), images in zip(batch, results):
                done.set_result(images)

    def next_batch(self) -> list[tuple[object, Future]] | None:
        with self.ready:
            self.ready.wait_for(lambda: self.pending or self.closed)
            if self.closed:
                return None
            if not self.window_s:
                return [self.pending.popleft()]
            first = self.pending[0][0]
            closes = time.monotonic() + self.window_s
            while self.fitting(first)[1] < self.max_images and (left := closes - time.monotonic()) > 0 and not self.closed:
                self.ready.wait(left)
            batch, _ = self.fitting(first)
            for item in batch:
                self.pending.remove(item)
            return batch

    def fitting(self, first) -> tuple[list, int]:
        """The waiting requests that can share a call with `first`, in arrival order, and their images."""
        batch, images = [], 0
        for item in self.pending:
            generation = item[0]
            if self.key(generation) == self.key(first) and images + generation.num_images <= max(self.max_images, first.num_images):
                batch.append(item)
                images += generation.num_images
        return batch, images
