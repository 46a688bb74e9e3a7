"""Would JPEG decode on the GPU help the image loader: `train.lever.gpu_jpeg_decode`, after the image configurations.

    python bench/train_decode.py --shards /tmp/shards --configs image512 --decode-bench 256

`--decode-bench N` (after the configurations of `--configs`, by default `image512`): the image loader's CPU work per JPEG (trainer.data.images'
decode_image + crop_to_bucket, one process, one thread as in a loader worker) against
torchvision.io.decode_jpeg on the GPU (batched, then scaled and cropped with interpolate) on N
JPEGs of the shards; a `train.lever.gpu_jpeg_decode` line with both, the loader's capacity
(num_workers / CPU s per image), the fastest image configuration's img/s and a verdict.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `trainer`, as under pytest

from bench.train_configs import parse_config  # noqa: E402
from bench.train_harness import Bench, note, parse, parser, since_start, start  # noqa: E402
from bench.train_latents import prepare_latents  # noqa: E402
from bench.train_timing import measure  # noqa: E402


def shard_jpegs(shards: str, count: int, resolution: int, size_multiple: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """(the first `count` JPEG members of the image shards, the bucket the loader crops each to at `resolution`)."""
    from trainer.data.plan import buckets_of
    from trainer.data.shards import ShardReader, index_shards
    index = index_shards(shards)
    sizes, assignment = buckets_of(index.aspect, resolution, size_multiple, True)
    reader, jpegs, buckets = ShardReader(index), [], []
    for row in range(len(index)):
        members = reader.read(row)
        data = members.get("jpg") or members.get("jpeg")
        if data:
            jpegs.append(data)
            buckets.append(sizes[assignment[row]])
        if len(jpegs) == count:
            break
    return jpegs, buckets


def cpu_decode_s(jpegs: list[bytes], buckets: list[tuple[int, int]]) -> float:
    """Seconds per image of the image loader's work, one process on one thread (as a DataLoader worker
    runs): trainer.data.images' decode_image + crop_to_bucket (scale to cover, crop, to a [-1, 1] tensor)."""
    import torch

    from trainer.data.images import crop_to_bucket, decode_image
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # DataLoader workers run torch on one thread each
    try:
        crop_to_bucket(decode_image(jpegs[0], "JPEG"), buckets[0], (0.5, 0.5))  # first-call costs out of the figure
        started = time.perf_counter()
        for data, bucket in zip(jpegs, buckets):
            crop_to_bucket(decode_image(data, "JPEG"), bucket, (0.5, 0.5))
        return (time.perf_counter() - started) / len(jpegs)
    finally:
        torch.set_num_threads(threads)


def gpu_crop_to_bucket(image, bucket: tuple[int, int]):
    """crop_to_bucket on the GPU: an image [3, H, W] uint8 scaled to cover the bucket (bicubic, antialiased,
    clamped as Pillow's 8-bit result is), centre-cropped, in [-1, 1]."""
    import torch.nn.functional as F

    from trainer.data.buckets import cover_and_crop
    (width, height), (left, top) = cover_and_crop(image.shape[2], image.shape[1], bucket, (0.5, 0.5))
    resized = F.interpolate(image[None].float(), size=(height, width), mode="bicubic", antialias=True).clamp_(0, 255)
    return resized[0, :, top:top + bucket[1], left:left + bucket[0]] / 127.5 - 1.0


def gpu_decode_s(jpegs: list[bytes], buckets: list[tuple[int, int]], device, chunk: int) -> float:
    """Seconds per image (wall, the GPU otherwise idle) of torchvision.io.decode_jpeg on the GPU, `chunk`
    JPEGs per call (a step's batch), then gpu_crop_to_bucket; the median of three passes after a warm-up."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg  # missing, it is the decode line's error, not the run's
    if device.type != "cuda":
        raise RuntimeError("no CUDA device: torchvision's GPU decode needs one")
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]

    def one_pass() -> None:
        for first in range(0, len(encoded), chunk):
            images = decode_jpeg(encoded[first:first + chunk], mode=ImageReadMode.RGB, device=device)  # as decode_image
            for image, bucket in zip(images, buckets[first:first + chunk]):
                gpu_crop_to_bucket(image, bucket)
        torch.cuda.synchronize(device)

    one_pass()  # nvJPEG's handles and the kernels' first launches
    times = []
    for _ in range(3):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / len(jpegs)


def decode_verdict(capacity: float, consumption: float | None, workers_needed: int | None, gpu_busy: float | None) -> str:
    """What the figures say about moving JPEG decode onto the GPU."""
    gpu_cost = f"~{gpu_busy:.1%} of the GPU's time at that rate" if gpu_busy is not None else "a GPU cost not measured here"
    if consumption is None:
        return f"no image configuration ran: the CPU loader can deliver {capacity:.0f} img/s; nothing to compare it with"
    if capacity >= consumption:
        return (f"the CPU loader keeps up ({capacity:.0f} img/s capacity >= {consumption:.0f} img/s consumed, "
                f"{capacity / consumption:.1f}x headroom): GPU decode would only add GPU work ({gpu_cost})")
    return (f"the CPU loader is short ({capacity:.0f} img/s capacity < {consumption:.0f} img/s consumed; "
            f"{workers_needed} workers would keep up): GPU decode would relieve it for {gpu_cost}")


def decode_bench(bench: Bench, lines: list[dict], count: int) -> dict:
    """The `train.lever.gpu_jpeg_decode` line: CPU loader vs GPU decode on `count` JPEGs of the shards."""
    args, models, device = bench.args, bench.models, bench.device
    image_lines = [line for line in lines if line.get("value") and line["metric"].startswith("train.config.")
                   and parse_config(line["config"]["name"]).source == "image"]
    fastest = max(image_lines, key=lambda line: line["value"]) if image_lines else None
    resolution = fastest["config"]["resolution"] if fastest else args.image_size
    jpegs, buckets = shard_jpegs(args.shards, count, resolution, models.size_multiple)
    cpu_s = cpu_decode_s(jpegs, buckets)
    capacity = args.num_workers / cpu_s
    consumption = fastest["value"] if fastest else None
    gpu_s, error = None, None
    try:
        gpu_s = gpu_decode_s(jpegs, buckets, device, fastest["config"]["batch"] if fastest else 32)
    except ImportError as missing:
        error = f"torchvision is not installed ({missing})"
    except RuntimeError as failed:
        error = f"{type(failed).__name__}: {str(failed)[:200]}"
    gpu_busy = consumption * gpu_s if consumption and gpu_s else None
    workers_needed = math.ceil(consumption * cpu_s) if consumption else None
    line = {"metric": "train.lever.gpu_jpeg_decode", "value": round(gpu_s * 1000, 3) if gpu_s else None,
            "unit": "GPU ms/image", "gpu_ms_per_image": round(gpu_s * 1000, 3) if gpu_s else None,
            "cpu_ms_per_image": round(cpu_s * 1000, 3), "cpu_loader_capacity_img_per_s": round(capacity, 1),
            "consumption_img_per_s": consumption, "consumption_config": fastest["config"]["name"] if fastest else None,
            "data_wait_share": fastest["config"]["data_wait_share"] if fastest else None,
            "workers_needed": workers_needed, "gpu_busy_share_at_consumption": round(gpu_busy, 4) if gpu_busy else None,
            "verdict": decode_verdict(capacity, consumption, workers_needed, gpu_busy)}
    if error:
        line["error"] = error
    line["config"] = {"images": len(jpegs), "resolution": resolution, "buckets": sorted({f"{w}x{h}" for w, h in buckets}),
                      "jpeg_kib_mean": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1), "num_workers": args.num_workers,
                      "nproc": os.cpu_count(),
                      "cpu": "trainer.data.images.decode_image + crop_to_bucket (Pillow bicubic), 1 process, 1 torch thread",
                      "gpu": "torchvision.io.decode_jpeg(list, device='cuda') per batch + interpolate (bicubic, antialias) "
                             "+ crop; wall time with the GPU otherwise idle",
                      "capacity": "num_workers / CPU s per image (reading the tar members and collating left out)"}
    return line


def main() -> None:
    arguments = parser(__doc__.splitlines()[0], "image512")
    arguments.add_argument("--decode-bench", type=int, default=256, metavar="N",
                           help="after the configurations, CPU loader vs GPU (torchvision) JPEG decode on N JPEGs of the shards")
    args = parse(arguments)
    session = start(args)
    prepare_latents(session)
    measure(session)
    session.emit({**decode_bench(session.bench, session.lines, args.decode_bench), **session.common})
    note(event="done", seconds=round(since_start(), 1))


if __name__ == "__main__":
    main()
