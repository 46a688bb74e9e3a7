"""Benchmark how robust the demo's recipe is: `demo.prompt_match_rate` over several UNet seeds.

The demo's match rate depends on the numbers a machine happens to compute (its thread count, its
vector unit), so one run says little about the next machine's. This runs the local recipe
(recipes/local.toml) through the trainer's own entry points, without the stack: the demo's
catalogue as shards, the autoencoder job once (kept in --work for the next call), then per seed (in
parallel processes of --threads threads each) the tokenizer job, the encode job, the training job (under
torchrun where the recipe's `cpu-processes` asks for several, each of --threads threads) and the
demo's twelve prompts, scored by the demo's classifier. One JSON line per seed (`train_s` the wall time of
the tokenizer, encode and training jobs, `train_cpu_s` their CPU time: on one thread, the wall time they
take on an idle core, the figure to compare on a shared machine), then `demo.prompt_match_rate_min` over
the seeds. With --grid each seed also draws the whole catalogue grid (atelier/prompt_match.py GRID_PROMPTS
x GRID_SEEDS, colours and shape) at the first guidance: the mean over the seeds, `demo.prompt_match_grid` for the
shipped recipe (the demo's model) and `demo.prompt_match_grid_variant` for anything changed.
A variant's `key=-` drops a shipped key: a transformer family (flow matching) refuses the UNet's
prediction-type and zero-terminal-snr.

    .venv/bin/python bench/demo_recipe.py --seeds 0,1,2,3 --threads 2 [--grid] [--variant NAME:steps=1600 ...]
    .venv/bin/python bench/demo_recipe.py --seeds 0,1 --threads 1 --grid --work /tmp/demo-grid \
        --variant dit:model-config=demo-pixart,prediction-type=-,zero-terminal-snr=-,steps=7000
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]

from bench.catalog_shards import write_shards  # noqa: E402


def recipe(name: str) -> dict[str, str]:
    """The local recipe's training hyperparameters (recipes/local.toml's `training.<name>`), as `atelier local up`
    sets them: `hyperparameters` or `autoencoder_hyperparameters`."""
    return tomllib.loads((REPO / "recipes" / "local.toml").read_text())["training"][name]


def argv(hyperparameters: dict[str, str]) -> list[str]:
    return [part for key, value in hyperparameters.items() for part in (f"--{key}", value)]


def one_seed(root: str, variant: str, overrides: dict[str, str], seed: int, threads: int, device: str,
             guidances: list[float], grid: bool = False) -> dict:
    """encode, train, draw DEMO_PROMPTS and score them, for one (variant, seed), in a process of its own."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: this process never sees a GPU
    import torch
    torch.set_num_threads(threads)
    from atelier.prompt_match import DEMO_PROMPTS, GRID_PROMPTS, GRID_SEEDS, STEPS, matches, matches_grid
    from trainer.jobs import encode, tokenizer, train
    from trainer.serve.generation import generate, load_pipeline
    from trainer.serve.protocol import parse_request
    from trainer.serve.settings import ServeSettings

    base, work = Path(root), Path(root) / f"{variant}-{seed}"
    shutil.rmtree(work, ignore_errors=True)  # a --work folder's earlier run of this variant would be resumed
    hyper = {key: value for key, value in {**recipe("hyperparameters"), "seed": str(seed), "validation-prompts": "",
                                           **overrides}.items() if value != "-"}  # `key=-` drops a shipped key
    started, cpu_started = time.monotonic(), time.process_time()
    # the lineage's tokenizers, learned from the training captions (the stack's tokenizer job), as the encode
    # and training jobs read them
    tokenizer.main(tokenizer.parse_args(["--train-dir", str(base / "shards"), "--model-dir", str(work / "tokenizer"),
                                         "--model-config", hyper["model-config"]]))
    encode.main(encode.parse_args(["--train-dir", str(base / "shards"), "--output-dir", str(work / "latents"),
                                   "--vae", str(base / "vae"), "--seed", str(seed), "--resolution", hyper["resolution"],
                                   "--model-config", hyper["model-config"], "--tokenizer", str(work / "tokenizer"),
                                   "--aspect-buckets", "false", "--num-workers", "0"]))
    hyper.pop("cpu-threads", None)  # the container's (torch threads, trainer/container.py): here --threads
    processes = int(hyper.pop("cpu-processes", "1"))  # the container's too: data-parallel under torchrun, as it runs them
    train_argv = ["--train-dir", str(work / "latents"), "--model-dir", str(work / "model"), "--vae", str(base / "vae"),
                  "--tokenizer", str(work / "tokenizer"), *argv({**hyper, "num-workers": "0"})]
    if processes > 1:
        data_parallel("trainer.jobs.train", train_argv, processes, threads, work / "train.log")
        summary = json.loads((work / "model" / "atelier-training.json").read_text())
    else:
        summary = train.main(train.parse_args(train_argv))
    trained_s, trained_cpu_s = time.monotonic() - started, time.process_time() - cpu_started
    pipeline = load_pipeline(work / "model")

    def draw(prompt: str, sample_seed: int, guidance: float) -> bytes:
        generation = parse_request(json.dumps({"prompt": prompt, "seed": sample_seed, "num_inference_steps": STEPS,
                                               "guidance_scale": guidance}).encode(), ServeSettings())
        png = io.BytesIO()
        generate(pipeline, generation)[0].save(png, format="PNG")
        return png.getvalue()

    scores = {}
    for guidance in guidances:
        matched = [matches(prompt, draw(prompt, 0, guidance)) for prompt in DEMO_PROMPTS]
        scores[f"{guidance:g}"] = {"rate": round(sum(matched) / len(matched), 3),
                                   "missed": [prompt for prompt, hit in zip(DEMO_PROMPTS, matched) if not hit]}
    # train_cpu_s: the process's CPU time (encode + train); on `threads` 1 the wall time of an idle core
    result = {"variant": variant, "overrides": overrides, "seed": seed, "processes": processes, "train_s": round(trained_s, 1),
              "train_cpu_s": round(trained_cpu_s, 1), "steps": summary["steps"],
              "final_loss": summary["final_loss"], "guidance": scores}
    if grid:
        pairs = [(prompt, sample_seed) for prompt in GRID_PROMPTS for sample_seed in GRID_SEEDS]
        hits = [matches_grid(prompt, draw(prompt, sample_seed, guidances[0])) for prompt, sample_seed in pairs]
        result["grid"] = round(sum(hits) / len(hits), 3)
        result["grid_missed"] = [f"{prompt} #{sample_seed}" for (prompt, sample_seed), hit in zip(pairs, hits) if not hit]
    return result


def data_parallel(module: str, job_argv: list[str], processes: int, threads: int, log: Path) -> None:
    """A job module (trainer.jobs.train or trainer.jobs.autoencoder) under torchrun, `processes` ranks of `threads`
    threads, as trainer/container.py runs a job's cpu-processes; its output goes to `log`."""
    from trainer.container import torchrun_command
    command = torchrun_command(job_argv, 0, {"current_host": "algo-1", "hosts": ["algo-1"]}, processes, module)
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "functions"), os.environ.get("PYTHONPATH")]))}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=REPO).returncode
    if status:
        raise RuntimeError(f"the data-parallel {module} job failed ({status}); see {log}")


def variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME' or 'NAME:key=value,key=value' (the local recipe's training hyperparameters, overridden; `key=-` removes one,
    as a transformer family must the UNet's prediction-type and zero-terminal-snr)."""
    name, _, pairs = text.partition(":")
    return name, dict(pair.split("=", 1) for pair in pairs.split(",") if pair)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3", help="comma-separated UNet seeds")
    parser.add_argument("--variant", action="append", type=variant, default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="a recipe to try: the local recipe's training hyperparameters with these overrides (default: shipped)")
    parser.add_argument("--guidance", default=None, help="comma-separated guidance scales to score (default: the demo's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (CI has 2 cores)")
    parser.add_argument("--workers", type=int, default=None, help="processes at once (default: one per job)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where each seed's jobs run")
    parser.add_argument("--images", type=int, default=None, help="training pictures (default: the demo's)")
    parser.add_argument("--grid", action="store_true", help="also score the whole catalogue grid (demo.prompt_match_grid)")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the data and the VAE here and reuse them on the next call (default: a temporary folder)")
    parser.add_argument("--autoencoder-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override an entry of the local recipe's autoencoder hyperparameters")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from atelier.catalog import DEMO_IMAGES, EVAL_IMAGES, procedural_catalog, training_combinations
    from atelier.prompt_match import GUIDANCE
    from trainer.jobs import autoencoder

    seeds = [int(seed) for seed in args.seeds.split(",")]
    variants = args.variant or [("shipped", {})]
    guidances = [float(g) for g in args.guidance.split(",")] if args.guidance else [GUIDANCE]
    count = args.images or DEMO_IMAGES
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    machine = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "device": args.device}
    with tempfile.TemporaryDirectory() as temporary:
        base = args.work or Path(temporary)
        root = str(base)
        made_s = None  # seconds the autoencoder job took, when this call made the VAE
        if not (base / "vae" / "config.json").is_file():  # a --work folder's data and VAE are made once
            catalogue = procedural_catalog(variants=-(-count // len(training_combinations())))[:count]
            write_shards(catalogue, base / "shards", int(tomllib.loads((REPO / "tuning" / "local.toml").read_text())["SHARD_MAX_SAMPLES"]), 64)
            write_shards(procedural_catalog(1, seed=1)[:EVAL_IMAGES], base / "eval", EVAL_IMAGES, 64)
            started = time.monotonic()
            hyper = {**recipe("autoencoder_hyperparameters"), "num-workers": "0",
                     **dict(item.split("=", 1) for item in args.autoencoder_set)}
            hyper.pop("cpu-threads", None)  # the container's, as for training: here --threads
            processes = int(hyper.pop("cpu-processes", "1"))
            vae_argv = ["--train-dir", str(base / "shards"), "--validation-dir", str(base / "eval"),
                        "--model-dir", str(base / "vae"), *argv(hyper)]
            if processes > 1:
                data_parallel("trainer.jobs.autoencoder", vae_argv, processes, args.threads, base / "vae.log")
            else:
                autoencoder.main(autoencoder.parse_args(vae_argv))
            made_s = round(time.monotonic() - started, 1)
        record = json.loads((base / "vae" / autoencoder.RECORD).read_text())  # the VAE the seeds train on, made now or before
        if made_s is not None:
            print(json.dumps({"event": "vae", "psnr_db": record["psnr_db"], "s": made_s}), flush=True)
        vae_used = {"psnr_db": record["psnr_db"], "seed": record["args"]["seed"], "steps": record["steps"],
                    "batch_size": record["args"]["batch_size"], "processes": record.get("world_size", 1)}
        jobs = [(name, overrides, seed) for name, overrides in variants for seed in seeds]
        results: dict[str, list[dict]] = {name: [] for name, _ in variants}
        # spawned, not forked: a fork of a process whose OpenMP pool has run deadlocks in torch
        with ProcessPoolExecutor(max_workers=args.workers or len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(one_seed, root, name, overrides, seed, args.threads, args.device, guidances, args.grid)
                       for name, overrides, seed in jobs]
            for future in futures:
                result = future.result()
                results[result["variant"]].append(result)
                print(json.dumps({"event": "seed", **result}), flush=True)
    for name, overrides in variants:
        processes = results[name][0]["processes"]  # the training job's, as one_seed ran it
        if args.grid:
            grid = [result["grid"] for result in results[name]]
            # the fixed name is the demo's model's: the local recipe as shipped, the demo's pictures and guidance
            shipped = not overrides and not args.autoencoder_set and count == DEMO_IMAGES and guidances[0] == GUIDANCE
            print(json.dumps({"metric": "demo.prompt_match_grid" if shipped else "demo.prompt_match_grid_variant",
                              "value": round(sum(grid) / len(grid), 3), "unit": "share",
                              "config": {"variant": name, "overrides": overrides, "guidance": guidances[0], "images": count,
                                         "threads": args.threads, "processes": processes, "seeds": seeds, "rates": grid,
                                         "vae": vae_used},
                              "machine": machine, "commit": commit}))
        for guidance in guidances:
            rates = [result["guidance"][f"{guidance:g}"]["rate"] for result in results[name]]
            print(json.dumps({"metric": "demo.prompt_match_rate_min", "value": min(rates), "unit": "share",
                              "config": {"variant": name, "overrides": overrides, "guidance": guidance, "images": count,
                                         "threads": args.threads, "processes": processes, "seeds": seeds, "rates": rates,
                                         "mean": round(sum(rates) / len(rates), 3),
                                         "train_s_median": sorted(r["train_s"] for r in results[name])[len(seeds) // 2]},
                              "machine": machine, "commit": commit}))


if __name__ == "__main__":
    main()
