"""The encode job's throughput on this machine's CPU, against the VAE encoder alone.

Procedural catalogue pictures (atelier.catalog) in shards of the packer's layout, encoded by
`trainer.jobs.encode.encode_shards` with the tiny preset. Prints one JSON line:
- encode.cpu_img_per_s: samples a second through encode_shards (reading, decoding, tokenizing,
  encoding, serialising and writing the shards), the median of --repeats runs after a warm-up;
- its `ratio_vs_vae`: that over the VAE encoder alone on as many images in batches of the same size,
  timed in the same rounds (A B A B ...). On a CPU the VAE is most of the work, so this says how
  much the rest of the job costs on top of it.

    .venv/bin/python bench/encode_cpu.py [--images 400] [--size 64] [--batch 32] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

import torch  # noqa: E402

from atelier.catalog import procedural_catalog, training_combinations  # noqa: E402
from bench.catalog_shards import write_shards  # noqa: E402
from trainer.data.latents import models_identity  # noqa: E402
from trainer.jobs.encode import encode_shards
from trainer.models.loading import load_models  # noqa: E402

CPU = torch.device("cpu")


def vae_seconds(models, images: int, size: int, batch: int) -> float:
    """The VAE encoder alone on `images` random pictures in batches of `batch`."""
    pixels = torch.rand(batch, 3, size, size) * 2 - 1
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, images, batch):
            models.vae.encode(pixels[:min(batch, images - start)]).latent_dist.parameters
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--size", type=int, default=64, help="picture side and encode resolution, px")
    parser.add_argument("--batch", type=int, default=32, help="images per VAE call")
    parser.add_argument("--workers", type=int, default=2, help="loader processes")
    parser.add_argument("--per-shard", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="encode-cpu-"))
    try:
        variants = -(-args.images // len(training_combinations()))
        write_shards(procedural_catalog(variants, size=args.size)[:args.images], work / "shards", args.per_shard, args.size)
        models = load_models("tiny", None, seed=0)
        identity = models_identity(models)
        encode_s, vae_s = [], []
        for round_number in range(args.repeats + 1):  # round 0 warms up
            shutil.rmtree(work / "latents", ignore_errors=True)
            started = time.perf_counter()
            summary = encode_shards(work / "shards", work / "latents", models, args.size, CPU, args.batch, args.workers,
                                    aspect_buckets=False, identity=identity)
            seconds = time.perf_counter() - started
            vae = vae_seconds(models, summary["samples_encoded"], args.size, args.batch)
            if round_number:
                encode_s.append(seconds)
                vae_s.append(vae)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    encode_median, vae_median = statistics.median(encode_s), statistics.median(vae_s)
    print(json.dumps({
        "metric": "encode.cpu_img_per_s", "value": round(args.images / encode_median, 1), "unit": "img/s",
        "ratio_vs_vae": round(vae_median / encode_median, 3), "baseline": "the VAE encoder alone, same images and batches",
        "config": {"images": args.images, "size": args.size, "batch": args.batch, "workers": args.workers,
                   "per_shard": args.per_shard, "repeats": args.repeats, "statistic": "median", "model_config": "tiny",
                   "encode_s": [round(s, 3) for s in encode_s], "vae_s": [round(s, 3) for s in vae_s]},
        "commit": commit(), "machine": {"nproc": os.cpu_count(), "gpu": None},
        "versions": {p: version(p) for p in ("torch", "diffusers", "safetensors")}}), flush=True)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return f"{head}+dirty" if dirty else head


if __name__ == "__main__":
    main()
