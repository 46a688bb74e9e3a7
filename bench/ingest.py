"""Benchmark the ingest stage's own work: decode, validate, normalise and describe one upload
(`core.ingest.metadata.describe`, everything ingest does between reading the bytes and writing records).

Prints one JSON line per figure:
- ingest.<fmt>_<size>_img_per_s_per_core: images per CPU-second (one process, one thread),
  with p50/p99 wall ms per image; for 1 MP JPEG, the fixed name ingest.jpeg_1mp_img_per_s_per_core.
- ingest.ratio_vs_full_decode: the same 1 MP JPEG figure / a plain full decode + RGB convert +
  sha256 (a baseline written here, labelled so), measured alternately in the same run.
- ingest.peak_rss_mib_100mp: peak RSS of a fresh process describing one 100 MP JPEG.
- ingest.derivative_psnr_db_12mp: PSNR of the 12 MP JPEG's stored derivative against the picture
  before it was uploaded (its pristine pixels, Lanczos-resized to the derivative's size), beside
  the same for a full decode + Lanczos to the maximum side + the same re-encode (a baseline written
  here: ingest's path before 2026-12, labelled so).
- with --phases: ingest.<case>_phase_cpu_ms, describe's CPU ms and the ms of its phases (each
  measured alone), for the 12 MP JPEGs and the 1 MP PNG; nothing else.
- with --before REV: ingest.<case>_ratio_vs_before, ours / REV's describe on the same input bytes,
  each tree in its own process, alternately (A B A B ...), medians of the rounds.

    .venv/bin/python bench/ingest.py [--repeat 40] [--before REV [--rounds 5]] [--phases]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFilter, ImageStat

REPO = Path(__file__).resolve().parents[1]
# a script, not a test: the Lambda code's own root, or another tree's (--before runs this file again on it)
FUNCTIONS = Path(os.environ.get("INGEST_BENCH_FUNCTIONS", REPO / "functions"))
sys.path.insert(0, str(FUNCTIONS))

from contracts.messages import Sidecar, UploadRef  # noqa: E402
from core.ingest.images import DecodePolicy  # noqa: E402
from core.ingest.metadata import describe  # noqa: E402
try:
    from core.ingest.settings import IngestSettings  # noqa: E402
except ImportError:  # a tree from before the settings were split by stage (--before)
    from core.ingest.settings import IngestSettings  # type: ignore[no-redef]  # noqa: E402

SETTINGS = IngestSettings(  # template.yaml's defaults
    table="-", pack_queue_url="-", data_bucket="-", max_upload_bytes=209715200,
    decode=DecodePolicy(frozenset({"jpeg", "png", "webp", "tiff"}), 178956970, (255, 255, 255), 2048, "auto"),
    min_short_side=256, max_aspect_ratio=4.0, jpeg_quality=95, near_duplicate_distance=3,
    near_duplicate_colour_distance=16, max_caption_chars=2000, sidecar_orphan_grace_s=3600, pack_lanes=1)
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


def encoded(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}), **params)
    return buffer.getvalue()


def cases() -> dict[str, bytes]:
    """The inputs of every figure, by case name (fmt_size[_variant]), made once."""
    made: dict[str, bytes] = {}
    for fmt, pil in (("jpeg", "JPEG"), ("png", "PNG")):
        for size_name, size in SIZES.items():
            made[f"{fmt}_{size_name}"] = encoded(photo(size), pil)
    # progressive JPEGs pay the truncation probe's second decode (images._scan_cut_short)
    made["jpeg_12mp_progressive"] = encoded(photo(SIZES["12mp"]), "JPEG", progressive=True)
    return made


def repeat_for(case: str, repeat: int) -> int:
    return repeat if "_1mp" in case else max(4, repeat // 8)


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


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio of two RGB pictures of one size, in dB, over all channels."""
    squares = sum(ImageStat.Stat(ImageChops.difference(a, b)).sum2)
    return 10 * math.log10(255 ** 2 * a.width * a.height * 3 / max(squares, 1e-9))


def derivative_psnr(pristine: Image.Image, derivative: bytes) -> tuple[float, tuple[int, int]]:
    """(PSNR, size) of a stored derivative against the pristine picture resized to its size."""
    with Image.open(io.BytesIO(derivative)) as stored:
        stored.load()
        return psnr(stored.convert("RGB"), pristine.resize(stored.size, Image.Resampling.LANCZOS)), stored.size


def full_decode_derivative(data: bytes) -> bytes:
    """Baseline (written here): ingest's derivative before 2026-12: every pixel decoded, one Lanczos
    resample to the maximum side, the same 4:4:4 re-encode."""
    from core.ingest.images import encode_jpeg
    with Image.open(io.BytesIO(data)) as image:
        return encode_jpeg(image.convert("RGB"), SETTINGS.decode.max_side, SETTINGS.jpeg_quality)[0]


def worker(inputs: Path, repeat: int) -> None:
    """--worker: CPU seconds per describe of every case in `inputs`, for the tree on sys.path, as JSON."""
    figures = {file.stem: measure(ours, file.read_bytes(), repeat_for(file.stem, repeat))[0]
               for file in sorted(inputs.glob("*.bin"))}
    print(json.dumps(figures))


def side_by_side(made: dict[str, bytes], before: str, rounds: int, repeat: int) -> None:
    """ours / `before`'s describe on the same bytes: each tree in a fresh process, A B A B ..."""
    with tempfile.TemporaryDirectory() as tmp:
        old_tree, inputs = Path(tmp) / "before", Path(tmp) / "inputs"
        old_tree.mkdir(), inputs.mkdir()
        archive = subprocess.run(["git", "archive", before, "functions"], cwd=REPO, capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(old_tree, filter="data")
        for case, data in made.items():
            (inputs / f"{case}.bin").write_bytes(data)
        runs: dict[str, list[dict[str, float]]] = {"ours": [], "before": []}
        for _ in range(rounds):
            for side, functions in (("ours", FUNCTIONS), ("before", old_tree / "functions")):
                out = subprocess.run([sys.executable, __file__, "--worker", str(inputs), "--repeat", str(repeat)],
                                     env={**os.environ, "INGEST_BENCH_FUNCTIONS": str(functions)},
                                     capture_output=True, text=True, check=True).stdout
                runs[side].append(json.loads(out))
    revision = subprocess.run(["git", "rev-parse", "--short", before], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    for case in made:
        ours_rate = statistics.median(1 / run[case] for run in runs["ours"])
        before_rate = statistics.median(1 / run[case] for run in runs["before"])
        line(f"ingest.{case}_ratio_vs_before", ours_rate / before_rate, "x", ours_img_per_s=round(ours_rate, 2),
             before={"commit": revision, "img_per_s": round(before_rate, 2)},
             config={"bytes": len(made[case]), "rounds": rounds, "repeat": repeat_for(case, repeat),
                     "order": "A B A B, a fresh process each"})


def phases(made: dict[str, bytes], repeat: int) -> None:
    """--phases: where describe's time goes, one phase at a time on the same bytes."""
    from core.ingest import images

    def cpu_ms(fn, data: bytes, n: int) -> float:
        return round(measure(lambda _: fn(), data, n)[0] * 1000, 2)

    def drafted(data: bytes, scale: int) -> None:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (image.width // scale, image.height // scale))
            image.load()

    policy = SETTINGS.decode
    for case in ("jpeg_12mp", "jpeg_12mp_progressive", "png_1mp"):
        data, n = made[case], repeat_for(case, repeat)
        decoded = images.decode(data, policy)
        parts = {"decode": cpu_ms(lambda: images.decode(data, policy), data, n)}
        if case.startswith("jpeg"):
            parts |= {f"one_decode_1/{scale}": cpu_ms(lambda scale=scale: drafted(data, scale), data, n)
                      for scale in (1, 2, 8)}
        else:
            stream = png_idat(data)
            parts["zlib_inflate_alone"] = cpu_ms(lambda: zlib.decompress(stream), data, n)
            parts |= {f"peer_{name}": cpu_ms(decode, data, n) for name, decode in png_peers(data, stream).items()}
        if decoded.reencode:
            parts["encode_jpeg"] = cpu_ms(lambda: images.encode_jpeg(decoded.rgb, policy.max_side,
                                                                     SETTINGS.jpeg_quality), data, n)
        parts["dhash"] = cpu_ms(lambda: images.dhash(decoded.rgb), data, n)
        parts["sha256"] = cpu_ms(lambda: hashlib.sha256(data).hexdigest(), data, n)
        line(f"ingest.{case}_phase_cpu_ms", cpu_ms(lambda: ours(data), data, n), "ms", phases=parts,
             config={"decoded_size": list(decoded.rgb.size), "bytes": len(data), "repeat": n})


def png_peers(data: bytes, stream: bytes) -> dict:
    """The PNG decoders and the inflate of other libraries, where installed (not in the Lambda
    package; `pip install zlib-ng pyspng imagecodecs` beside the bench): what a decoder outside
    Pillow would cost. Pillow's wheels inflate with zlib-ng; Python's zlib module is the system's."""
    peers = {}
    with contextlib.suppress(ImportError):
        from zlib_ng import zlib_ng
        peers["zlib_ng_inflate_alone"] = lambda: zlib_ng.decompress(stream)
    with contextlib.suppress(ImportError):
        import pyspng
        peers["pyspng_decode"] = lambda: pyspng.load(data)
    with contextlib.suppress(ImportError):
        import imagecodecs
        peers["imagecodecs_libpng_decode"] = lambda: imagecodecs.png_decode(data)
    return peers


def png_idat(data: bytes) -> bytes:
    """The zlib stream of a PNG: its IDAT chunks' data, joined."""
    position, stream = 8, bytearray()
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        if kind == b"IDAT":
            stream += data[position + 8:position + 8 + length]
        position += 12 + length
    return bytes(stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--before", help="a git revision to compare with, side by side on the same bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--phases", action="store_true", help="per-phase CPU ms of describe, and nothing else")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.repeat)
    made = cases()
    if args.phases:
        return phases(made, args.repeat)
    for case, data in made.items():
        repeat = repeat_for(case, args.repeat)
        cpu, walls = measure(ours, data, repeat)
        with Image.open(io.BytesIO(data)) as image:
            size = image.size
        line(f"ingest.{case}_img_per_s_per_core", 1 / cpu, "img/s", p50_ms=round(statistics.median(walls), 2),
             p99_ms=round(sorted(walls)[max(0, int(len(walls) * 0.99) - 1)], 2),
             config={"size": list(size), "bytes": len(data), "repeat": repeat})
    if args.before:
        side_by_side(made, args.before, args.rounds, args.repeat)
    # the 12 MP derivative's quality, ours and the full-decode path, against the picture before upload
    pristine = photo(SIZES["12mp"], seed=1)
    upload = encoded(pristine, "JPEG")
    derivative = describe(upload, UPLOAD, "partner", Sidecar(caption="c", license="l"), "l", SETTINGS).derivative
    assert derivative is not None
    ours_db, ours_size = derivative_psnr(pristine, derivative)
    base_db, base_size = derivative_psnr(pristine, full_decode_derivative(upload))
    line("ingest.derivative_psnr_db_12mp", ours_db, "dB", size=list(ours_size), baseline_psnr_db=round(base_db, 2),
         baseline_size=list(base_size),
         baseline="full decode + Lanczos to the maximum side + q95 (ours before 2026-12, labelled)",
         config={"upload": "12 MP photo, JPEG q90", "reference": "pristine pixels, Lanczos to the derivative's size",
                 "quality": SETTINGS.jpeg_quality})
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
