"""Benchmark the ingest stage's own work: decode, validate, normalise and describe one upload
(`core.metadata.describe`, everything ingest does between reading the bytes and writing records).

Prints one JSON line per figure:
- ingest.<fmt>_<size>_img_per_s_per_core: images per CPU-second (one process, one thread),
  with p50/p99 wall ms per image; for 1 MP JPEG, the fixed name ingest.jpeg_1mp_img_per_s_per_core.
- ingest.ratio_vs_full_decode: the same 1 MP JPEG figure / a plain full decode + RGB convert +
  sha256 (a baseline written here, labelled so), measured alternately in the same run.
- ingest.peak_rss_mib_100mp: peak RSS of a fresh process describing one 100 MP JPEG.

    .venv/bin/python bench/ingest.py [--repeat 40]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "functions"))  # a script, not a test: the Lambda code's own root

from core.images import DecodePolicy  # noqa: E402
from core.metadata import describe  # noqa: E402
from core.models import Sidecar, UploadRef  # noqa: E402
from core.settings import IngestSettings  # noqa: E402

SETTINGS = IngestSettings(  # template.yaml's defaults
    table="-", pack_queue_url="-", data_bucket="-", max_upload_bytes=209715200,
    decode=DecodePolicy(frozenset({"jpeg", "png", "webp", "tiff"}), 178956970, (255, 255, 255), 2048, "auto"),
    min_short_side=256, max_aspect_ratio=4.0, jpeg_quality=95, near_duplicate_distance=3)
UPLOAD = UploadRef(bucket="b", key="partner/x", event_time="2026-11-29T00:00:00Z")
SIZES = {"1mp": (1155, 866), "12mp": (4000, 3000)}


def photo(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """Photo-like content: smooth gradients, shapes, blur and grain (noise alone is a worst case)."""
    rng = random.Random(seed)
    small = Image.linear_gradient("L").resize((size[0] // 8, size[1] // 8)).convert("RGB")
    draw = ImageDraw.Draw(small)
    for _ in range(40):
        x, y = rng.randrange(small.width), rng.randrange(small.height)
        r = rng.randrange(5, max(6, small.width // 6))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
    image = small.resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2))
    grain = Image.effect_noise(size, 12).convert("RGB")
    return Image.blend(image, grain, 0.08)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def ours(data: bytes) -> None:
    describe(data, UPLOAD, "partner", Sidecar(caption="c", license="l"), "l", SETTINGS)


def full_decode(data: bytes) -> None:
    """Baseline (written here): what a plain validator does: decode all pixels, to RGB, hash."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        image.convert("RGB")
    hashlib.sha256(data).hexdigest()


def measure(fn, data: bytes, repeat: int) -> tuple[float, list[float]]:
    """(CPU seconds per image, wall ms per image) after one warm-up call."""
    fn(data)
    walls: list[float] = []
    cpu0 = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        fn(data)
        walls.append((time.perf_counter() - start) * 1000)
    return (time.process_time() - cpu0) / repeat, walls


def peak_rss_100mp() -> tuple[float, float]:
    """(peak RSS MiB, RSS MiB before describing) of a fresh process that reads a 100 MP JPEG
    from a file and describes it; the picture is made here, so its making is not counted."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".jpg") as file:
        file.write(encoded(photo((10000, 10000)), "JPEG"))
        file.flush()
        # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import ingest; "
                f"data = open({file.name!r}, 'rb').read(); base = ingest.vm_hwm_kib(); ingest.ours(data); "
                "print(ingest.vm_hwm_kib(), base)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) / 1024, int(out[1]) / 1024


def vm_hwm_kib() -> int:
    """This process's peak resident set, from /proc (Linux)."""
    for row in Path("/proc/self/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def line(metric: str, value: float, unit: str, **context: object) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 2), "unit": unit, "commit": commit(),
                      "machine": {"nproc": os.cpu_count(), "gpu": None}, **context}), flush=True)


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    for fmt, pil in (("jpeg", "JPEG"), ("png", "PNG")):
        for size_name, size in SIZES.items():
            data = encoded(photo(size), pil)
            repeat = args.repeat if size_name == "1mp" else max(4, args.repeat // 8)
            cpu, walls = measure(ours, data, repeat)
            name = f"ingest.{fmt}_{size_name}_img_per_s_per_core"
            line(name, 1 / cpu, "img/s", p50_ms=round(statistics.median(walls), 2),
                 p99_ms=round(sorted(walls)[max(0, int(len(walls) * 0.99) - 1)], 2),
                 config={"size": list(size), "bytes": len(data), "repeat": repeat})
    # ours and the baseline alternately (A B A B ...), so both see the same machine noise
    data = encoded(photo(SIZES["1mp"]), "JPEG")
    ratios = []
    for _ in range(5):
        ours_cpu, _ = measure(ours, data, args.repeat // 4 or 1)
        base_cpu, _ = measure(full_decode, data, args.repeat // 4 or 1)
        ratios.append(base_cpu / ours_cpu)
    line("ingest.ratio_vs_full_decode", statistics.median(ratios), "x", baseline="full decode + RGB + sha256 (ours, labelled)",
         config={"size": list(SIZES["1mp"]), "rounds": 5})
    peak, before = peak_rss_100mp()
    line("ingest.peak_rss_mib_100mp", peak, "MiB", rss_before_mib=round(before, 1),
         config={"size": [10000, 10000], "format": "jpeg", "store_max_side": 2048})


if __name__ == "__main__":
    main()
