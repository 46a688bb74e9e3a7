"""The trainer's training step timed: one configuration's warm-up, timed and profiled steps of
trainer.jobs.step.train_step (trainer.objectives.diffusion.diffusion_loss with the trainer's default
noise offset and min-SNR settings, backward, gradient clipping, the all-ranks finiteness check,
AdamW, the EMA, the LR schedule), for shards through the trainer's loader (`index_shards`,
`BatchPlan`, `StepBatches`, `make_loader`) with its own data-wait timing
(`trainer.runtime.health.Window`); and the configurations of a run one after another, each a JSON line.

The first configuration also gives `train.first_step_s`: process start to the first optimizer step,
with the same setup order as trainer.jobs.train.main (models built, the UNet on the GPU already, the frozen
parts moved there, optimizer, EMA, shards indexed, loader started).

`--compile-cache DIR`: a compiled first configuration loads its shape's trainer.speed.compile_cache file before
its first step and saves it after, and its first step is also reported as
`train.first_step_s_compiled_warm` (a file was loaded) or `_cold`. Run it twice, each process with its
own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so only the file carries the compile.

The first configuration also gives `train.first_step_s`: process start to the first optimizer step,
with the same setup order as trainer.jobs.train.main (models built, the UNet on the GPU already, the frozen
parts moved there, optimizer, EMA, shards indexed, loader started).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.train_configs import (apply_fast_default, apply_model_levers, lever_unavailable, parse_config, release,
                                 switch_precision_and_attention, without_last_lever)
from bench.train_figures import flops_fields, profile_summary
from bench.train_harness import names, note, since_start
from bench.train_latents import latent_dir_of
from bench.train_shards import CAPTIONS

if TYPE_CHECKING:  # the trainer and torch are imported late: their import time counts in train.first_step_s
    from bench.train_configs import Configuration
    from bench.train_harness import Bench, Session
    from trainer.data.loader import StepBatches
    from trainer.speed.compile_cache import CacheKey, JobCache


def resident_latents(models, batch: int, resolution: int, device, pool: int = 4):
    """Batches of precomputed latents already on the GPU, cycled (unet-only, latents resident)."""
    import torch
    side = resolution // models.vae_scale_factor
    tensors = [torch.randn(batch, models.denoiser.config.in_channels, side, side, device=device) for _ in range(pool)]
    # SDXL's size/crop conditioning of an uncropped square: original size, crop top-left, target size
    time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]] * batch, dtype=torch.float32)
    number = 0
    while True:
        yield {"latents": tensors[number % pool], "caption": [CAPTIONS[(number + i) % len(CAPTIONS)] for i in range(batch)],
               "time_ids": time_ids, "key": [str(i) for i in range(batch)], "corrupt": [], "shard": []}
        number += 1


def latent_batches(bench: Bench, resolution: int, plan, accumulation: int) -> StepBatches:
    """The trainer's own latent-shard dataset over the shards `--encode` wrote at this resolution."""
    from trainer.data.latents import check_latent_shards
    from trainer.data.loader import StepBatches
    from trainer.data.plan import BatchPlan
    from trainer.data.shards import index_shards
    from trainer.models.text import caption_ids
    models, processes = bench.models, bench.processes
    if resolution not in bench.latent_indexes:
        index = index_shards(latent_dir_of(bench, resolution), processes.local_rank, processes.local_world_size)
        # as trainer.jobs.train does; the identity (a hash of the VAE and text encoders) was taken for the directory
        check_latent_shards(index, models, {resolution}, bench.identity)
        bench.latent_indexes[resolution] = index
    index = bench.latent_indexes[resolution]
    batch_plan = BatchPlan(index.aspect, plan, bench.args.seed, processes.rank, accumulation, models.size_multiple,
                           True)
    return StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False, caption_ids(models, [""])[0].numpy())


def step_module(model, config: Configuration):
    """What the step calls: the model itself, compiled as `trainer.jobs.train --compile`, or compiled with CUDA graphs."""
    import torch
    if config.graphs:  # one graph per bucket shape, replayed; the step's inputs are copied into its static buffers
        return torch.compile(model, dynamic=False, mode="reduce-overhead")
    return torch.compile(model, dynamic=False) if config.compile else model


def start_batches(bench: Bench, config: Configuration, plan, batch: int) -> tuple:
    """(the micro-batches in step order, whether the loader pins them): the trainer's loader over image or
    latent shards, planned for `accumulation` micro-batches per step as trainer.jobs.train plans them; or resident latents."""
    from trainer.data.loader import StepBatches, make_loader
    from trainer.data.plan import BatchPlan
    from trainer.data.shards import index_shards
    args, models, processes = bench.args, bench.models, bench.processes
    if config.source == "resident":
        return resident_latents(models, batch, config.resolution, bench.device), None
    if config.source == "image":
        if bench.image_index is None:
            bench.image_index = index_shards(args.shards, processes.local_rank, processes.local_world_size)
            bench.marks["shards_indexed"] = since_start()
        index = bench.image_index
        batch_plan = BatchPlan(index.aspect, plan, args.seed, processes.rank, config.accumulation, models.size_multiple,
                               True)
        dataset = StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False)
    else:
        dataset = latent_batches(bench, config.resolution, plan, config.accumulation)
    loader = make_loader(dataset, args.num_workers, pin_memory=config.pin_memory)
    return iter(loader), loader.pin_memory


def first_marked(batches, marks: dict[str, float]):
    """The batches, the first one's arrival marked as the `first_batch` phase of train.first_step_s."""
    first = next(batches)
    marks["first_batch"] = since_start()
    yield first
    yield from batches


def run_config(bench: Bench, config: Configuration, steps: int, warmup: int, first: bool) -> dict:
    """`warmup` steps, `steps` timed ones and, with --profile, 3 profiled ones of trainer.jobs.step.train_step."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from trainer.data.phases import plan_from_args
    from trainer.jobs.step import StepSettings, Trainee, train_step
    from trainer.runtime import distributed
    from trainer.runtime.ema import EMA
    from trainer.runtime.health import Window
    from trainer.speed.cuda_graphs import GraphedBackward
    from trainer.speed.vae_compile import compile_vae_encoder

    args, models, processes, device = bench.args, bench.models, bench.processes, bench.device
    unet = models.denoiser
    resolution, batch, accumulation = config.resolution, bench.batch_of(config), config.accumulation
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    if config.channels_last:
        unet.to(memory_format=torch.channels_last)
    switch_precision_and_attention(bench, config, on=True)
    # inductor leaves the UNet's training graph in NCHW (its heuristic skips convolutions with twice as many
    # input as output channels, the decoder's skip concatenations), so cuDNN transposes around each conv
    import torch._inductor.config
    torch._inductor.config.force_layout_optimization = config.force_layout_opt
    if config.vae_compile:
        compile_vae_encoder(models, channels_last=config.vae_channels_last)
    detail = apply_model_levers(bench, config)
    model = distributed.wrap(unet, processes, "ddp")
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    profile_steps = 3 if config.name in bench.profile else 0
    plan = plan_from_args(None, warmup + steps + profile_steps, batch, resolution, None, 0, models.default_resolution)
    # what clipping, AdamW and the EMA update: the UNet's parameters, or with bf16w their fp32 masters
    trained = bench.master_weights.masters if bench.master_weights else unet
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1.0, fused=True if config.fused_adamw else None)
    if bench.master_weights:
        bench.master_weights.track(optimizer)  # each step copies the masters into the bf16 weights
    # `model` keeps DDP's gradient-sync switch and the step calls step_module(model), as in trainer.jobs.train
    step_model = step_module(model, config)
    trainee = Trainee(trained, model, step_model, optimizer,
                      LambdaLR(optimizer, lambda steps_done: plan.learning_rate(steps_done + 1)),
                      EMA(trained.named_parameters(), 0.9999),
                      GraphedBackward(step_model, list(trained.parameters())) if config.step_graphs else None)
    del model, optimizer
    settings = StepSettings(seed=args.seed, gradient_accumulation=accumulation,
                            sync_every_micro_batch=config.sync_every_micro_batch)
    batches, pinned = start_batches(bench, config, plan, batch)
    if first:
        bench.marks["loader_started"] = since_start()
        batches = first_marked(batches, bench.marks)

    step_times, skipped, window, losses = [], 0, Window(), []
    figures, profiler = None, None
    for step in range(1, plan.total_steps + 1):
        if step == warmup + 1:
            window = Window()  # the timed steps only
        if step == warmup + steps + 1:  # the profiled steps, after the timed ones
            torch.cuda.synchronize() if device.type == "cuda" else None
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        started = time.perf_counter()
        if config.graphs:  # a new step: the graphs' output buffers from the last one may be reused
            torch.compiler.cudagraph_mark_step_begin()
        outcome = train_step(trainee, models, batches, window, settings, step, processes)
        skipped += not outcome.finite
        losses.append(outcome.loss)
        elapsed = time.perf_counter() - started  # the step ends in host syncs (.item()), so this is its wall time
        if first and step == 1:
            bench.marks["first_step"] = since_start()
        if warmup < step <= warmup + steps:
            step_times.append(elapsed)
        if step == warmup + steps:
            figures = window.figures(window.loss_sum.item() / max(window.good_steps, 1))
        if step == 1 or step == warmup or step == plan.total_steps:
            note(config=config.name, step=step, step_s=round(elapsed, 3), loss=round(outcome.loss.item(), 4))
    profile = None
    if profiler is not None:
        torch.cuda.synchronize() if device.type == "cuda" else None
        profiler.__exit__(None, None, None)
        profile = profile_summary(profiler, profile_steps)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    losses = [round(loss, 5) for loss in torch.stack(losses).tolist()]
    del trainee, batches, profiler, outcome, trained
    release(bench, config)
    median = statistics.median(step_times)
    images_per_step = batch * accumulation
    return {"batch": batch, "accumulation": accumulation, "images_per_step": images_per_step, "resolution": resolution,
            "pin_memory": pinned, "median_step_s": round(median, 4),
            "img_per_s": round(images_per_step / median, 2), "img_per_s_window_mean": figures["img_per_s"],
            "data_wait_share": figures["data_wait_share"], "peak_gpu_mem_gib": round(peak_gib, 2) if peak_gib else None,
            "timed_steps": len(step_times), "warmup_steps": warmup, "skipped_steps": skipped,
            "step_s_min_max": [round(min(step_times), 4), round(max(step_times), 4)], "loss": figures["loss"],
            **detail, "profile": profile, "losses": losses}


# ---------------------------------------------------------------- a run's configurations


SOURCE_LABELS = {"image": "image shards, VAE + text encoder online",
                 "latent": "latent shards (trainer/jobs/encode.py) through the trainer's loader; text encoder online on stored ids",
                 "resident": "unet-only, latents resident (random latents on the GPU; NOT latent shards)"}


def config_line(bench: Bench, config: Configuration, result: dict, measured: dict[str, float], wall_s: float) -> dict:
    """A configuration's line: img/s, its ratios to the configurations it is measured against, FLOPs and MFU."""
    name, base, value = config.name, config.base, result["img_per_s"]
    line = {"metric": f"train.config.{name}", "value": value, "unit": "img/s"}
    if name != base and base in measured:
        line["ratio_vs_plain"], line["plain_img_per_s"] = round(value / measured[base], 3), measured[base]
    without = without_last_lever(name)
    if without in measured:
        line["ratio_vs_without"] = round(value / measured[without], 3)
        line["without"], line["without_img_per_s"] = without, measured[without]
    line.update(flops_fields(bench, config.source, result["resolution"], value))
    line["config"] = {"name": name, "source": SOURCE_LABELS[config.source],
                      "channels_last": config.channels_last, "fused_adamw": config.fused_adamw,
                      "torch_compile": config.compile, "cuda_graphs": config.graphs, "step_graphs": config.step_graphs,
                      "cudnn_benchmark": config.cudnn_benchmark, "vae_compile": config.vae_compile,
                      "vae_channels_last": config.vae_channels_last, "force_layout_opt": config.force_layout_opt,
                      "gradient_sync": "every micro-batch" if config.sync_every_micro_batch else "last micro-batch",
                      "weights": ("bf16 + fp32 master (trainer.speed.master_weights)" if config.bf16_weights
                                  else "fp32" if config.fp32 else "fp32 under bf16 autocast"),
                      "fp8": (f"torchao float8, tensorwise dynamic scaling, {result.get('float8_linears')} "
                              "transformer-block linears" if config.fp8 else None),
                      "groupnorm_silu": (f"fused {result.get('groupnorm_silu_path')}, "
                                         f"{result.get('groupnorm_silu_blocks')} ResnetBlock2D"
                                         if config.fused_groupnorm_silu else "GroupNorm then SiLU"),
                      "world_size": bench.processes.world_size, **result, "config_wall_s": round(wall_s, 1)}
    if config.sync_every_micro_batch and bench.processes.world_size == 1:
        line["config"]["note"] = "world size 1: no all-reduce either way; sync means something under torchrun only"
    return line


@dataclass
class FirstCache:
    """The compile cache of the first configuration's shape, as trainer.jobs.train keys and loads it."""
    key: CacheKey
    job: JobCache
    outcome: dict  # JobCache.load's account of what it loaded


def first_config_cache(bench: Bench, config: Configuration, directory: str) -> FirstCache:
    """The compile cache of the first configuration's shape, as trainer.jobs.train keys and loads it."""
    from trainer.speed.compile_cache import JobCache, cache_key
    key = cache_key(bench.models.denoiser, bench.device, "image" if config.source == "image" else "latent",
                    config.resolution, bench.batch_of(config), config.channels_last, bench.processes.world_size)
    job = JobCache(Path(directory), [key], bench.processes.rank, environ={})
    return FirstCache(key, job, job.load())


def measure(session: Session, compile_cache: str | None = None) -> dict[str, dict | None]:
    """Each configuration of `--configs` in order: its line (a skipped or failed one says why) and its profile's;
    after the first, `train.first_step_s` and `train.data_wait_share` (with `compile_cache`, a compiled first
    configuration loads its shape's file first and its first step is also `train.first_step_s_compiled_warm` or
    `_cold`). Returns the profiles by configuration name."""
    import torch
    args, bench, common, emit = session.args, session.bench, session.common, session.emit
    device, processes, marks = bench.device, bench.processes, bench.marks
    machine = common["machine"]
    measured: dict[str, float] = {}  # img/s of every configuration run so far, by name
    profiles: dict[str, dict | None] = {}  # their profiles (--profile), by name
    cache = None  # the first configuration's compiled shape, loaded before its first step
    for number, name in enumerate(names(args)):
        config = apply_fast_default(parse_config(name), args.model_config)
        if number == 0 and config.compile and compile_cache:
            cache = first_config_cache(bench, config, compile_cache)
            emit({"metric": "train.compile_cache_load", "value": len(cache.outcome["loaded"]), "unit": "files",
                  "config": {"name": name, **cache.outcome}, **common})
        left = args.deadline - since_start()
        skip = lever_unavailable(config, device, processes.world_size)
        if not skip and left < (args.compile_needs if config.compile else 20):
            skip = f"{left:.0f} s left before the deadline"
        if skip:
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "skipped": skip, **common})
            continue
        warmup = args.compile_warmup if config.compile else args.warmup
        started, failure = time.time(), None
        try:
            result = run_config(bench, config, args.steps, warmup, first=number == 0)
        except torch.OutOfMemoryError as error:
            failure = f"OOM: {str(error)[:200]}"
        except RuntimeError as error:  # a lever that fails (CUDA graphs, say) leaves the other configurations their run
            if name == config.base:
                raise
            failure = f"{type(error).__name__}: {str(error)[:300]}"
        if failure:
            release(bench, config)  # out here, where no traceback holds the failed step's tensors any more
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "error": failure, **common})
            continue
        profile, _ = result.pop("profile"), result.pop("losses")
        line = config_line(bench, config, result, measured, time.time() - started)
        measured[name], profiles[name] = result["img_per_s"], profile
        emit({**line, **common})
        if profile:
            emit({"metric": f"train.profile.{name}", "value": profile["gpu_ms_per_step"], "unit": "GPU ms/step (kernels)",
                  "config": {"name": name, "batch": result["batch"], "profiled_steps": 3}, **profile,
                  "commit": common["commit"], "machine": machine})
        if number == 0:
            emit({"metric": "train.first_step_s", "value": round(marks["first_step"], 1), "unit": "s", "goal": 45,
                  "config": {"name": name, "phases_s": {k: round(v, 1) for k, v in marks.items()},
                             "note": "process start -> first optimizer step, trainer.jobs.train.main's setup order"}, **common})
            if cache is not None:  # a compiled first configuration with --compile-cache: warm or cold
                warm = bool(cache.outcome["loaded"])
                emit({"metric": f"train.first_step_s_compiled_{'warm' if warm else 'cold'}", "value": round(marks["first_step"], 1),
                      "unit": "s", "goal": 45 if warm else None,
                      "config": {"name": name, "cache_file": cache.key.file_name, "loaded": warm,
                                 "saved": cache.job.save(0), "phases_s": {k: round(v, 1) for k, v in marks.items()},
                                 "note": "process start -> first optimizer step; warm: trainer.speed.compile_cache's file from "
                                         "an earlier process, its own Inductor and Triton directories empty"}, **common})
            emit({"metric": "train.data_wait_share", "value": result["data_wait_share"], "unit": "share of step time",
                  "goal": 0.005, "config": {"name": name, "num_workers": args.num_workers, "batch": result["batch"],
                                            "timed_steps": result["timed_steps"]}, **common})
    return profiles
