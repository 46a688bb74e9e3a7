"""Synthetic image shards for the training benchmarks, in the packer's layout (and, for the diffusers
baseline, the same JPEGs as an imagefolder):

    python bench/train_shards.py --shards /tmp/bench-shards --samples 2048 [--image-size 512] [--imagefolder DIR]

Every bench/train_*.py script also takes `--make-shards N` to write them first, in its own process
(the clock of `train.first_step_s` starts after them).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
from multiprocessing import Pool
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "functions")]  # contracts, shared with the Lambdas

CAPTIONS = ["a red dog on the beach", "a photo of a city street at night", "a bowl of fruit on a table",
            "a mountain lake at sunrise", "a small boat on a blue sea", "two people walking in a green forest"]


def synthetic_jpeg(seed: int, size: int) -> bytes:
    """A smooth random picture with some grain, saved as a q90 JPEG (about the size of a photo's)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.Resampling.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def write_shard(job: tuple) -> int:
    """One shard in the packer's layout (<sha256>.jpg, .json, .txt); the same JPEGs in an imagefolder."""
    path, first, count, size, folder = job
    metadata = []
    from contracts import shard_members
    with tarfile.open(path, "w", format=shard_members.TAR_FORMAT) as tar:
        for number in range(first, first + count):
            data = synthetic_jpeg(number, size)
            key = hashlib.sha256(data).hexdigest()
            caption = CAPTIONS[number % len(CAPTIONS)]
            record = json.dumps({"width": size, "height": size, "format": "JPEG", "partner": "bench",
                                 "license": "synthetic"}).encode()
            members = (("jpg", data), (shard_members.RECORD, record), (shard_members.CAPTION, caption.encode()))
            for extension, body in members:
                tar.addfile(shard_members.tarinfo(shard_members.member_name(key, extension), len(body)), io.BytesIO(body))
            if folder:
                (Path(folder) / f"{key}.jpg").write_bytes(data)
                metadata.append(json.dumps({"file_name": f"{key}.jpg", "text": caption}))
    if folder:
        (Path(folder) / f"metadata-{first:08d}.part").write_text("\n".join(metadata) + "\n")
    return count


def make_shards(directory: Path, samples: int, size: int, per_shard: int, folder: Path | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
    jobs = [(str(directory / f"shard-{first // per_shard:05d}.tar"), first, min(per_shard, samples - first), size,
             str(folder) if folder else None) for first in range(0, samples, per_shard)]
    with Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.map(write_shard, jobs)
    if folder:
        parts = sorted(folder.glob("metadata-*.part"))
        (folder / "metadata.jsonl").write_text("".join(part.read_text() for part in parts))
        for part in parts:
            part.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="/tmp/bench-shards")
    parser.add_argument("--samples", type=int, required=True, help="how many synthetic JPEG samples")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--imagefolder", default=None, help="also write the same JPEGs here (for the diffusers baseline)")
    args = parser.parse_args()
    make_shards(Path(args.shards), args.samples, args.image_size, args.per_shard,
                Path(args.imagefolder) if args.imagefolder else None)


if __name__ == "__main__":
    main()
