"""The data, the base and the two timed runs of bench/time_to_target.py: the procedural catalogue written as
shards and as an imagefolder, the autoencoder job's VAE and the base pipeline, then our encode and training
jobs and the peer's script, each watched from process start for its checkpoints and log events. Also what
bench/family_ttt.py shares with it: a run's record in --work, a base with another denoiser, the time to a
target loss, and the JSON lines both print.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.catalog_shards import write_shards

REPO = Path(__file__).resolve().parents[1]
SAVED = re.compile(rb"Saved state to \S*checkpoint-(\d+)")
EVENT = re.compile(rb'^\{"event": "(\w+)"', re.MULTILINE)


@dataclass
class Run:
    name: str
    started: float = 0.0
    checkpoints: dict[int, float] = field(default_factory=dict)  # step -> seconds since start, when complete
    directories: dict[int, Path] = field(default_factory=dict)  # step -> its UNet directory
    phases: dict[str, float] = field(default_factory=dict)


def timed(work: Path, name: str, runner) -> Run:
    """`runner()`, its record saved in --work, or the record this --work already holds (a second call picks up
    where one stopped; with `runner` None the record must be there)."""
    record = work / f"{name}-run.json"
    if record.is_file():
        saved = json.loads(record.read_text())
        # the name the run was made with (the peer is "diffusers" in peer-run.json); where a record has none, its file's
        return Run(saved.get("name", name), 0.0, {int(k): v for k, v in saved["checkpoints"].items()},
                   {int(k): Path(v) for k, v in saved["directories"].items()}, saved["phases"])
    if runner is None:
        raise FileNotFoundError(f"no run recorded in {record}")
    run = runner()
    record.write_text(json.dumps({"name": run.name, "checkpoints": run.checkpoints, "phases": run.phases,
                                  "directories": {step: str(path) for step, path in run.directories.items()}}))
    return run


# ---------------------------------------------------------------- data


def catalogue_chunk(seed: int, variants: int, size: int) -> list:
    from atelier.catalog import procedural_catalog
    return procedural_catalog(variants, size=size, seed=seed)


def make_catalogue(count: int, size: int, seed: int, workers: int) -> list:
    """`count` pictures from `workers` independent seeds (procedural_catalog is sequential per seed)."""
    from atelier.catalog import training_combinations
    variants = -(-count // (len(training_combinations()) * workers))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        chunks = list(pool.map(catalogue_chunk, [seed * 1000 + n for n in range(workers)], [variants] * workers,
                               [size] * workers))
    return [item for chunk in chunks for item in chunk][:count]


def write_imagefolder(items: list, folder: Path) -> None:
    """datasets' imagefolder: the PNGs and metadata.jsonl with `file_name` and `text`."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metadata.jsonl", "w") as metadata:
        for number, item in enumerate(items):
            name = f"{number:06d}.png"
            (folder / name).write_bytes(item.image)
            metadata.write(json.dumps({"file_name": name, "text": item.sidecar["caption"]}) + "\n")


def prepare(args, work: Path) -> None:
    """The data, the VAE and the base, each made once per --work (a VAE put there beforehand is kept)."""
    if not (work / "folder" / "metadata.jsonl").is_file():  # written last
        started = time.monotonic()
        items = make_catalogue(args.images, args.size, 0, args.workers)
        seen = {item.image for item in items}
        held_out = [item for item in make_catalogue(args.eval_images * 2, args.size, 1, 2) if item.image not in seen]
        write_shards(items, work / "shards", args.per_shard, args.size)
        write_shards(held_out[:args.eval_images], work / "eval", args.eval_images, args.size)
        write_imagefolder(items, work / "folder")
        progress("data", images=len(items), eval_images=min(len(held_out), args.eval_images), s=time.monotonic() - started)
    if not (work / "vae" / "config.json").is_file():
        train_vae(args, work)
    if not (work / "base" / "model_index.json").is_file():
        build_base(args, work)


def train_vae(args, work: Path) -> None:
    from trainer.jobs import autoencoder
    started = time.monotonic()
    vae = autoencoder.main(autoencoder.parse_args([
        "--train-dir", str(work / "shards"), "--validation-dir", str(work / "eval"), "--model-dir", str(work / "vae"),
        "--model-config", args.model_config, "--resolution", str(args.size), "--steps", str(args.vae_steps),
        "--batch-size", str(args.vae_batch), "--learning-rate", str(args.vae_learning_rate), "--reconstruction-loss", "mse",
        "--aspect-buckets", "false", "--random-crop", "false", "--num-workers", str(min(args.workers, 8)),
        "--log-every", str(max(args.vae_steps // 6, 1)), "--checkpoint-dir", str(work / "vae-checkpoints"),
        "--checkpoint-every", str(max(args.vae_steps // 6, 1))]))  # a stopped call resumes it
    progress("vae", psnr_db=vae["psnr_db"], s=time.monotonic() - started)


def build_base(args, work: Path) -> None:
    """The base pipeline: the VAE in --work, the preset's other parts at seed 0, the scheduler of the recipe."""
    import torch
    from trainer.models.loading import load_models
    from trainer.models.pipelines import build_pipeline
    from trainer.objectives.diffusion import zero_terminal_snr
    models = load_models(args.model_config, None, 0, vae=str(work / "vae"))
    models.noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if args.zero_terminal_snr:
        models.noise_scheduler = zero_terminal_snr(models.noise_scheduler)
    build_pipeline(models, models.denoiser).save_pretrained(work / "base")
    del models
    torch.cuda.empty_cache()


def pipeline_with(base: Path, denoiser: Path, folder: Path) -> Path:
    """The base pipeline with another denoiser (its `unet/` or `transformer/`): links, no copies."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for entry in base.iterdir():
        swapped = entry.name in ("unet", "transformer") and entry.is_dir()
        (folder / entry.name).symlink_to(denoiser.resolve() if swapped else entry.resolve())
    return folder


# ---------------------------------------------------------------- the timed runs


def watch(command: list[str], log: Path, on_chunk=None, done=None, env=None) -> int:
    """Run `command`, its output to `log`; `on_chunk(bytes, now)` sees it; stops it when `done()`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    with open(log, "ab") as out:
        while True:
            chunk = process.stdout.read1(65536)
            if not chunk:
                break
            out.write(chunk)
            if on_chunk:
                on_chunk(chunk, time.monotonic())
            if done and done():
                process.terminate()  # measured: skip its final save
                break
    code = process.wait(timeout=120)
    return 0 if done and done() else code


def poll_checkpoints(folder: Path, run: Run, stop: threading.Event) -> None:
    """Stamp each step-N/ when it appears: the trainer renames a checkpoint into place once complete."""
    while not stop.is_set():
        if folder.is_dir():
            for path in folder.glob("step-*"):
                step = int(path.name.split("-")[1])
                if step not in run.checkpoints and path.is_dir():
                    run.checkpoints[step] = time.monotonic() - run.started
                    run.directories[step] = path / "unet"
        time.sleep(0.05)


def timeline(run: Run, job: str):
    """An on_chunk that records when each of a job's log events (`{"event": NAME, ...}`) first shows,
    in seconds from the run's start, as `run.phases["<job>.<NAME>_s"]`: where the fixed costs go."""
    def seen(chunk: bytes, now: float) -> None:
        for match in EVENT.finditer(chunk):
            run.phases.setdefault(f"{job}.{match.group(1).decode()}_s", round(now - run.started, 1))
    return seen


def encode_then_train(run: Run, log: Path, encode: list[str], train: list[str], checkpoints: Path, done) -> int:
    """`run` from process start: the encode job with `encode` flags (a failure raises), then the training job with
    `train` flags until `done()`, each step-N/ in `checkpoints` stamped as it completes; the training job's code."""
    python = [sys.executable, "-m"]
    # the image puts the one package of functions/ the trainer shares (contracts) on its path
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "functions"), os.environ.get("PYTHONPATH")]))}
    run.started = time.monotonic()
    code = watch([*python, "trainer.jobs.encode", *encode], log, on_chunk=timeline(run, "encode"), env=path)
    if code:
        raise RuntimeError(f"the {run.name} encode job failed ({code}); see {log}")
    run.phases["encoded_s"] = round(time.monotonic() - run.started, 1)
    progress(f"{run.name} encoded", s=run.phases["encoded_s"])
    stop = threading.Event()
    threading.Thread(target=poll_checkpoints, args=(checkpoints, run, stop), daemon=True).start()
    code = watch([*python, "trainer.jobs.train", *train], log, on_chunk=timeline(run, "train"), done=done, env=path)
    time.sleep(0.5)  # the poller's last look
    stop.set()
    return code


def recipe(args, seed: int = 0) -> list[str]:
    """The training job's flags both benches hold fixed: constant learning rate, clipping 1, no EMA, no caption
    dropout, centred crops, every checkpoint kept, the trained (not averaged) weights; `seed` draws its order,
    noise and timesteps."""
    return ["--batch-size", str(args.batch), "--learning-rate", str(args.learning_rate), "--max-grad-norm", "1",
            "--ema-decay", "0", "--final-weights", "trained", "--caption-dropout", "0", "--aspect-buckets", "false",
            "--random-crop", "false", "--num-workers", str(min(args.workers, 8)),
            "--checkpoint-every", str(args.checkpoint_every), "--keep-checkpoints", "1000",
            "--log-every", str(args.checkpoint_every), "--validation-prompts", "", "--seed", str(seed)]


def run_ours(args, work: Path, name: str, extra: str) -> Run:
    """Our encode job, then our training job with `extra` flags; `name` names its records in --work."""
    run, checkpoints, latents, base = Run(name), work / f"{name}-checkpoints", work / "latents", work / "base"
    shutil.rmtree(checkpoints, ignore_errors=True)
    shutil.rmtree(latents, ignore_errors=True)
    last = args.steps
    code = encode_then_train(
        run, work / f"{name}.log",
        ["--train-dir", str(work / "shards"), "--output-dir", str(latents), "--pretrained", str(base),
         "--model-config", args.model_config, "--resolution", str(args.size), "--aspect-buckets", "false",
         "--batch-size", str(args.encode_batch), "--num-workers", str(args.workers), *args.encode_args.split()],
        ["--train-dir", str(latents), "--model-dir", str(work / "ours-model"), "--checkpoint-dir", str(checkpoints),
         "--resume", "none", "--pretrained", str(base), "--init-unet", "pretrained", "--model-config", args.model_config,
         "--steps", str(args.steps), "--resolution", str(args.size), *recipe(args), *extra.split()],
        checkpoints, done=lambda: last in run.checkpoints)
    if code or last not in run.checkpoints:
        raise RuntimeError(f"the training job failed ({code}); see {work / (name + '.log')}")
    return run


def run_peer(args, work: Path) -> Run:
    run, output = Run("diffusers"), work / "peer-output"
    shutil.rmtree(output, ignore_errors=True)
    last = args.steps

    def saved(chunk: bytes, now: float) -> None:
        for match in SAVED.finditer(chunk):  # a line is one write: it does not straddle chunks
            step = int(match.group(1))
            run.checkpoints.setdefault(step, now - run.started)
            run.directories[step] = output / f"checkpoint-{step}" / "unet"

    run.started = time.monotonic()
    code = watch([sys.executable, str(args.peer_script), "--pretrained_model_name_or_path", str(work / "base"),
                  "--train_data_dir", str(work / "folder"), "--image_column", "image", "--caption_column", "text",
                  "--resolution", str(args.size), "--center_crop", "--train_batch_size", str(args.batch),
                  "--max_train_steps", str(args.steps), "--learning_rate", str(args.learning_rate),
                  "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--max_grad_norm", "1",
                  "--mixed_precision", "bf16", "--dataloader_num_workers", str(min(args.workers, 8)),
                  "--output_dir", str(output), "--checkpointing_steps", str(args.checkpoint_every), "--seed", "0",
                  *args.peer_args.split()],
                 work / "peer.log", on_chunk=saved, done=lambda: last in run.checkpoints,
                 env={"PYTHONPATH": os.pathsep.join(filter(None, [args.peer_path, os.environ.get("PYTHONPATH")]))})
    if code or last not in run.checkpoints:
        raise RuntimeError(f"the peer script failed ({code}); see {work / 'peer.log'}")
    return run


# ---------------------------------------------------------------- scores and output


def time_to(target: float | None, run: Run, scores: dict[int, dict]) -> tuple[int | None, float | None]:
    """(the first scored checkpoint at or under `target`, its seconds from process start); None, None if none."""
    for step in sorted(scores):
        if target is not None and scores[step]["val_loss"] <= target:
            return step, round(run.checkpoints[step], 1)
    return None, None


OUT: list[Path] = []  # --out, when given: each line is appended as it is made (a timed-out call keeps them)


def emit_to(path: Path) -> None:
    """Append every line `emit` prints to `path` too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    OUT.append(path)


def emit(line: dict) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    for path in OUT:
        with open(path, "a") as out:
            out.write(text + "\n")


def progress(what: str, **values) -> None:
    print(json.dumps({"progress": what, **{k: round(v, 1) if isinstance(v, float) else v for k, v in values.items()}}),
          file=sys.stderr, flush=True)
