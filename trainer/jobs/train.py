"""Train a latent-diffusion UNet (SD-1/2 or SDXL style) on Atelier shards; save a diffusers pipeline.

Runbook
-------
One process (CPU, or one GPU when there is one):

    python -m trainer.jobs.train --train-dir shards/ --model-dir out/model \\
        --checkpoint-dir out/checkpoints --steps 200 --model-config tiny

One host, N GPUs (DDP; rank 0 alone logs and writes; add `--strategy fsdp` to shard an SDXL-size
UNet, its gradients and optimizer state):

    torchrun --standalone --nproc_per_node N -m trainer.jobs.train <the same arguments>

Several hosts: `torchrun --nnodes H --node_rank R --master_addr <host 0> --nproc_per_node N ...`
on each (trainer/container.py does this from SageMaker's resourceconfig.json).

SageMaker: the image's entrypoint (`python -m trainer.container train`) turns the job's
hyperparameters into these arguments, passes `--checkpoint-dir /opt/ml/checkpoints` (synced to S3
by CheckpointConfig) and uses torchrun when there are several GPUs or hosts. `--train-dir`, `--index-dir`
(the shards' sample tables: no tar is walked at start), `--model-dir` and `--output-data-dir` default to
$SM_CHANNEL_TRAIN, $SM_CHANNEL_INDEXES, $SM_MODEL_DIR and $SM_OUTPUT_DATA_DIR; $SM_HPS supplies the others.

Progressive resolution: `--run-config sd2-progressive` (configs/runs/) lists phases of resolution,
batch size, learning rate and steps; the run moves through them by itself (trainer/data/phases.py).

Resuming: `--resume latest` (the default) continues from the newest checkpoint in `<checkpoint-dir>`
whose manifest verifies, if there is one, and logs each newer one it skips (`checkpoint_skipped`,
with the reason). Every batch and every noise draw is a pure function of (seed, step, rank),
so the resumed job trains on exactly what the uninterrupted one would have and its loss curve is
the same; on another number of GPUs it continues with its own draws. `--resume none` starts over;
`--resume <checkpoint dir>` picks one, and the job stops at once if it does not verify.
Checkpoints: trainer/runtime/checkpoints.py; what each saves, and the run's record at the end, is one
RunState (trainer/runtime/run_state.py). The step, shared with bench/train_timing.py: trainer/jobs/step.py.

Provenance (docs/provenance.md): `--manifest` (default $SM_CHANNEL_MANIFEST) lists samples the loader never
reads; `draws` in atelier-training.json counts the samples drawn per partner and license, over all ranks and jobs.

Families: a preset's `family` (trainer/models/families.py) trains a UNet, or an SD3 / PixArt transformer with flow matching;
on latent shards a family trains on the text embeddings they hold and loads no text encoder (trainer/data/latents.py).
Fine-tuning: `--pretrained <pipeline> --train lora` trains a LoRA adapter on the base's attention alone (UNet, SD3:
trainer/models/lora.py); `<model-dir>` then holds the base's pipeline files, `pytorch_lora_weights.safetensors` and
`atelier-lora.json` (the base's digest), and each checkpoint the adapter alone and the base's digest, which a resume
checks.
Arguments and their SageMaker defaults: trainer/jobs/train_args.py.
Output: `<model-dir>` holds the pipeline (`DiffusionPipeline.from_pretrained(model_dir)`; the EMA
weights unless `--final-weights trained`) and `atelier-training.json`; `<output-data-dir>` holds
`loss.png` and `validation/step-N.png` (a grid of fixed prompts x seeds at each checkpoint); both
hold `report.html`, the run's self-contained report (trainer/report/write.py).
Logs: JSON lines on stdout (trainer/runtime/health.py); each training line also carries `steps` (the total),
`progress` (steps done / total) and `eta_s` (seconds left at the step rate since the line before).
Too many non-finite steps in a row end the job with the reason in `$SM_OUTPUT_DIR/failure`.
Before the models load, every rank's device, free memory and an all-reduce over all ranks are checked
(trainer/runtime/preflight.py); no optimizer step for `--watchdog-minutes` dumps the stacks and ends the job
(trainer/runtime/watchdog.py). Both name the host and rank in that failure reason.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.s3_layout import TRAINING_RECORD
from trainer.data.buckets import bucket_shapes, widest_side
from trainer.data.captions import read_captions
from trainer.data.latents import check_latent_shards
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards, load_exclusions
from trainer.data.phases import plan_from_args
from trainer.jobs.sampling import check_health, save_model, weights_to_sample
from trainer.jobs.step import StepSettings, Trainee, train_step
from trainer.jobs.train_args import parse_args
from trainer.models import lora
from trainer.models.families import check_flow_run, check_positions, learned_unconditional, saved_record
from trainer.models.loading import load_models, preset_geometry
from trainer.models.text import caption_ids
from trainer.objectives.diffusion import zero_terminal_snr
from trainer.report.write import write_report
from trainer.runtime import distributed, preflight
from trainer.runtime.checkpoint_writer import CheckpointWriter
from trainer.runtime.checkpoints import checkpoint_to_resume, load_checkpoint, take_snapshot
from trainer.runtime.ema import EMA
from trainer.runtime.health import NonFiniteLossError, Window, draw_loss_curve, log, write_failure
from trainer.runtime.run_state import RunState
from trainer.runtime.tensorboard_log import Board, default_dir
from trainer.runtime.watchdog import stops_watchdogs, training_watchdog
from trainer.speed import cuda_graphs
from trainer.speed.compile_cache import LINEAGE_FOLDER, JobCache, cache_key
from trainer.speed.fast_defaults import compile_by_default, graphs_by_default, measured_preset
from trainer.speed.regional_compile import allow_graphs, compile_mode, compile_regions
from trainer.speed.vae_compile import compile_vae_encoder


# ---------------------------------------------------------------- helpers


def progress_and_eta(step: int, total: int, window_steps: int, window_s: float) -> dict:
    """How far the run is and the seconds left at the step rate since the last log line (None: no rate yet)."""
    rate = window_steps / window_s if window_steps > 0 and window_s > 0 else 0.0
    return {"steps": total, "progress": round(step / total, 4),
            "eta_s": round((total - step) / rate, 1) if rate else None}


def log_checkpoints(rank: int, writer: CheckpointWriter) -> None:
    """A `checkpoint` line for each checkpoint now complete on disk."""
    for step, path in writer.finished():
        log(rank, event="checkpoint", step=step, dir=str(path))


def cuda_graphs_for(args, preset: str | None, resolutions: list[int], processes: distributed.Processes) -> bool:
    """`--cuda-graphs`: true where they can run (else the job stops at start, saying why), false, or auto
    (where configs/defaults/fast.json measured them faster for the `preset` (fast_defaults.measured_preset) and
    every phase's resolution)."""
    reason = cuda_graphs.usable(processes.device, processes.world_size)
    if args.cuda_graphs == "auto":
        return reason is None and preset is not None and graphs_by_default(preset, resolutions)
    if args.cuda_graphs and reason:
        raise ValueError(f"--cuda-graphs true: {reason}; run with --cuda-graphs false or auto")
    return args.cuda_graphs


def training_captions(args: argparse.Namespace, processes):
    """The captions a tokenizer is learned from when neither the base nor --tokenizer brings one: every
    shard of the host, so each rank learns the same; several hosts (their own shards each) need --tokenizer."""
    def captions():
        if processes.world_size > processes.local_world_size:
            raise ValueError("several hosts would learn different tokenizers from their own shards: give --tokenizer "
                             "(the pipeline's tokenizer job writes one)")
        return read_captions(args.train_dir, args.manifest, args.index_dir)
    return captions


# ---------------------------------------------------------------- main


@stops_watchdogs
def main(args: argparse.Namespace) -> dict:
    """Train, checkpoint, save the pipeline; return what atelier-training.json records."""
    # setup
    processes = distributed.setup()
    rank, device = processes.rank, processes.device
    log(rank, event="imported")  # the job's fixed costs show in its log: imports, models, data, compile
    # before anything loads
    checks = preflight.check(processes, args.preflight_timeout, args.preflight_min_free_fraction)
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    health_dir = Path(args.output_data_dir) if args.output_data_dir else Path(args.model_dir) / "health"

    # models: the same initial weights on every rank; the UNet built on the device (trainer/models/loading.py)
    if not args.pretrained:  # a preset's resolution is checked first: learning its tokenizers reads the shards
        multiple, default_resolution = preset_geometry(args.model_config)
        plan_from_args(args.run_config, args.steps, args.batch_size, args.resolution, args.learning_rate,
                       args.lr_warmup_steps, default_resolution, args.lr_final_fraction, args.first_step, multiple)
    # this process's samples, indexed first: a transformer family on latent shards loads no text encoder at all
    index = index_shards(args.train_dir, processes.local_rank, processes.local_world_size,
                         load_exclusions(args.manifest), args.index_dir)
    models = load_models(args.model_config, args.pretrained, args.seed, args.vae, args.init_unet, device,
                         args.tokenizer, training_captions(args, processes), text_encoders=not index.latent)
    # --train lora: the base frozen, an adapter's parameters alone train (trainer/models/lora.py)
    lora.adapt(models, args, lora.frozen_dtype(device, args.strategy, processes.world_size))
    torch.manual_seed(args.seed + rank)  # any draw outside the seeded step generators differs per rank
    random.seed(args.seed + rank)
    empty_ids = check_flow_run(models.family, args) if models.family else None  # before the UNet-only options
    if args.prediction_type:
        models.noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if args.zero_terminal_snr:
        models.noise_scheduler = zero_terminal_snr(models.noise_scheduler)
    plan = plan_from_args(args.run_config, args.steps, args.batch_size, args.resolution, args.learning_rate,
                          args.lr_warmup_steps, models.default_resolution, args.lr_final_fraction, args.first_step,
                          models.size_multiple)
    if models.family is not None:
        check_positions(models.denoiser, models.vae_scale_factor, widest_side(
            [phase.resolution for phase in plan.phases], models.size_multiple, args.aspect_buckets), args.model_config)
    models.frozen_to(device)
    # whose measured levers --compile auto and --cuda-graphs auto follow: a base's architecture's, not --model-config's
    source = models.sources.get("transformer") or models.sources.get("unet") or ""
    measured = measured_preset(args.model_config, type(models.denoiser).__name__, models.denoiser.config,
                               from_base=source.startswith("--pretrained"))
    log(rank, event="models", pretrained=args.pretrained, init_unet=args.init_unet, train=args.train,
        speed_table=measured)
    unet = models.denoiser
    if args.channels_last:
        unet.to(memory_format=torch.channels_last)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compiled = compile_mode(args.compile, measured is not None and compile_by_default(
        measured, [phase.resolution for phase in plan.phases], device.type == "cuda"),
        models.family.name if models.family else None, args.strategy == "fsdp" and processes.world_size > 1)
    compiling = compiled is not None
    if compiling:  # graphs for every bucket shape: past Dynamo's limits, the other shapes would run eager
        shapes = bucket_shapes([phase.resolution for phase in plan.phases], models.size_multiple, args.aspect_buckets)
        log(rank, event="compile", mode=compiled, shapes=shapes, recompile_limit=allow_graphs(compiled, shapes))
    if compiled == "regional":  # before the wrap: FSDP shards these same blocks
        compile_regions(unet, models.family.name)
    model = distributed.wrap(unet, processes, args.strategy)
    step_model = model  # what the step calls; `model` keeps DDP's / FSDP's gradient-sync switches
    if compiled == "whole":
        step_model = torch.compile(model, dynamic=False)  # one graph per bucket shape, compiled at its first step
    fused = args.fused_adamw and device.type == "cuda" and args.strategy == "ddp"
    trained = [(name, parameter) for name, parameter in unet.named_parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in trained], lr=1.0, fused=fused or None)  # the schedule sets each rate
    lr_schedule = LambdaLR(optimizer, lambda steps_done: plan.learning_rate(steps_done + 1))
    ema = EMA(trained, args.ema_decay) if args.ema_decay > 0 else None
    graphing = cuda_graphs_for(args, measured, [phase.resolution for phase in plan.phases], processes)
    graphs = cuda_graphs.GraphedBackward(step_model, [p for _, p in trained]) if graphing else None
    trainee = Trainee(unet, model, step_model, optimizer, lr_schedule, ema, graphs)
    settings = StepSettings.from_args(args)
    base_digest = None  # a LoRA run's base by its files' digest: checkpoints carry it, a resume must find it again
    if args.train == "lora" and checkpoint_dir is not None:
        started = time.perf_counter()
        base_digest = distributed.from_rank_zero(lambda: lora.base_digest(models.base))  # one read of its files
        log(rank, event="lora_base", digest=base_digest, seconds=round(time.perf_counter() - started, 1))
    state = RunState(args=vars(args), base_digest=base_digest)  # what each checkpoint saves and the record ends with
    resume_from = checkpoint_to_resume(args.resume, checkpoint_dir)
    if resume_from is not None:
        state = RunState.from_dict(load_checkpoint(resume_from, processes, unet, optimizer, lr_schedule, ema), rank)
        if base_digest is not None:
            lora.check_same_base(resume_from, state.base_digest, base_digest, args.pretrained)
        state.args, state.base_digest = vars(args), base_digest  # this job's go into its checkpoints and its record
        log(rank, event="resumed", checkpoint=str(resume_from), step=state.step, stage=state.stage)
    step = plan.check_resumed(state.step)  # a plan starting at a later step goes on from the step before it

    # data: batches that are a pure function of (seed, step, rank)
    if index.latent:  # latent shards (trainer/jobs/encode.py): the VAE never runs, nor a family's text encoders
        check_latent_shards(index, models, {phase.resolution for phase in plan.phases})
        if models.family is None:
            empty_ids = caption_ids(models, [""])[0].numpy()  # what a dropped caption becomes
    if compiled == "whole" and not index.latent:  # image shards: the VAE encoder runs on every step (1.37x for the
        compile_vae_encoder(models)             # UNet's at 512, bench/RESULTS.md; not measured for the families' VAEs)
    batch_plan = BatchPlan(index.aspect, plan, args.seed, rank, args.gradient_accumulation, models.size_multiple,
                           args.aspect_buckets, keys=index.key)
    dataset = StepBatches(index, batch_plan, step + 1, plan.total_steps, args.caption_dropout, args.random_crop,
                          empty_ids, embeddings=index.latent and models.family is not None)
    batches = iter(make_loader(dataset, args.num_workers))
    state.corrupt.update(index.problems)
    log(rank, event="data", kind="latent" if index.latent else "image", samples=len(index), shards=len(index.shards),
        corrupt=len(index.problems), first_corrupt=index.problems[:5], excluded=index.excluded, scanned=index.scanned)

    compile_cache = None  # Inductor's output from an earlier job with these shapes (trainer/speed/compile_cache.py)
    if compiling and args.compile_cache != "none":
        cache_dir = (Path(args.compile_cache) if args.compile_cache
                     else checkpoint_dir / LINEAGE_FOLDER if checkpoint_dir else None)
        keys = [cache_key(unet, device, "latent" if index.latent else "image", phase.resolution, phase.batch_size,
                          args.channels_last, processes.world_size, compiled) for phase in plan.phases]
        compile_cache = JobCache(cache_dir, keys, rank)
        log(rank, event="compile_cache", **compile_cache.load())

    # loop
    log(rank, event="start", step=step, steps=plan.total_steps, world_size=processes.world_size, device=str(device),
        backend=processes.backend, strategy=args.strategy, compile=compiled or False, cuda_graphs=graphing, sdxl=models.sdxl, stages=plan.describe(),
        preflight=checks)
    watchdog = training_watchdog(args.watchdog_minutes, rank, step)
    board = Board(None if args.tensorboard_dir == "none" else Path(args.tensorboard_dir or default_dir(health_dir)), rank)
    window, skipped_in_a_row, phase, logged_step = Window(), 0, None, step
    writer = CheckpointWriter(checkpoint_dir, processes, args.keep_checkpoints, args.async_checkpoints) \
        if checkpoint_dir else None
    while step < plan.total_steps:
        step += 1
        if plan.phase_index(step) != phase:  # the logged event and key keep their first name, `stage`
            phase = plan.phase_index(step)
            log(rank, event="stage", step=step, **plan.describe()[phase],
                batches_per_epoch=batch_plan.batches_per_epoch(phase))
        outcome = train_step(trainee, models, batches, window, settings, step, processes)
        state.step, state.stage = step, phase
        for batch in outcome.batches:
            state.count(batch)
        if outcome.finite:
            skipped_in_a_row = 0
        else:  # the step's data is passed over and the weights stay as they were
            skipped_in_a_row += 1
            state.skipped_steps += 1
            log(rank, event="skipped_step", step=step, reason="non-finite loss or gradient", in_a_row=skipped_in_a_row)
            if skipped_in_a_row >= args.max_nonfinite_steps:
                reason = (f"NonFiniteLossError: {skipped_in_a_row} steps in a row up to step {step} had a NaN or "
                          "infinite loss or gradient")
                if rank == 0:
                    write_failure(reason)
                raise NonFiniteLossError(reason)
        watchdog.pet(step)
        if compile_cache and compile_cache.first_step_of(phase):  # the phase's graphs now exist
            log(rank, event="compile_cache_saved", step=step, **(compile_cache.save(phase) or {}))
        if step % args.log_every == 0 or step == plan.total_steps:
            window_sums = torch.stack([window.loss_sum, torch.tensor(float(window.good_steps))]).to(device)
            loss_sum, good_steps = distributed.mean(window_sums).tolist()
            mean_loss = loss_sum / good_steps if good_steps else float("nan")
            if good_steps:
                state.loss_history.append((step, mean_loss))
            figures = window.figures(mean_loss)
            state.history.append({"step": step, **{k: figures[k] for k in ("loss", "img_per_s", "data_wait_share")}})
            board.figures(step, lr=outcome.learning_rate, **figures)
            log(rank, step=step, stage=phase, lr=outcome.learning_rate, **figures,
                skipped_steps=state.skipped_steps, corrupt_samples=len(state.corrupt),
                **progress_and_eta(step, plan.total_steps, step - logged_step, time.perf_counter() - window.start))
            window, logged_step = Window(), step
        if writer:
            writer.check()  # a checkpoint write that failed stops the job here
            log_checkpoints(rank, writer)
        if writer and (step % args.checkpoint_every == 0 or step == plan.total_steps):
            with window.paused():
                writer.save(take_snapshot(processes, unet, optimizer, lr_schedule, ema, state.gathered().to_dict()))
                if compile_cache:  # the bucket shapes compiled since
                    compile_cache.save(phase)
                check_health(args, processes, models, unet, ema, plan, step, state.loss_history, health_dir, board)
    if writer:  # the last checkpoint is on disk before the job reports its end
        writer.wait()
        log_checkpoints(rank, writer)
    watchdog.stop()
    board.close()

    # save: the pipeline with the EMA (or trained) weights, and the run's record
    weights = weights_to_sample(unet, ema, use_ema=args.final_weights == "ema")
    record = state.gathered().record(models.sources, plan.describe(),
                                     "ema" if ema is not None and args.final_weights == "ema" else "trained")
    if rank == 0:
        model_dir = Path(args.model_dir)
        adapter = save_model(models, weights, plan.phases[-1].resolution, model_dir, args.pretrained)
        if adapter is not None:  # a LoRA run's model is its base and the adapter: the record names the base
            record["base"] = adapter["base"]
        record["tokenizer"] = models.tokenization  # where the tokenizers came from, and the captions cut at the context
        # whether the model can be guided by true CFG unasked (a Flux without guidance embeddings), kept for the runs
        # that continue from it, whose own sources name it as a base
        record["learned_unconditional"] = learned_unconditional(record, saved_record(models.base))
        (model_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        draw_loss_curve(state.loss_history, health_dir / "loss.png")
        write_report(model_dir, health_dir, job=os.environ.get("TRAINING_JOB_NAME"))  # SageMaker sets it
        log(rank, event="saved", model_dir=str(model_dir), steps=state.step, final_loss=record["final_loss"])
    # DDP's reducer (C++) holds the process group. Were it the last holder, the group would end with the
    # wrapper when main returns, with the GIL held, and wait for gloo's threads, one of which may still
    # need the GIL to free the last collective's tensors: a hang (gdb; on 2 busy cores, 18 of 60 runs of a
    # shrunk copy, none with this). Dropped first, the group ends in teardown(), which releases the GIL.
    del trainee, graphs, step_model, model
    distributed.barrier()
    distributed.teardown()
    return record


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
