"""Benchmark the packer: CPU per shard byte against webdataset's TarWriter, and peak RSS vs shard size.

    .venv/bin/python bench/pack.py                 # the recorded run (about 10 minutes, 2 cores)
    .venv/bin/python bench/pack.py --sizes-mib 100 --repeats 1   # a quick look
    git archive HEAD functions | tar -x -C /tmp/before && .venv/bin/python bench/pack.py --before /tmp/before/functions

moto runs as its own process (`python -m moto.server`); each measured packer runs in a fresh
child process that makes the calls PackFunction makes (`core.pack.packer.pack_samples`, one call per
SQS batch, then the seal) against it, and reports its own user+sys CPU (the S3 client's work
included, moto's not) and its peak RSS. webdataset's TarWriter writes the same samples, held in
memory, to a local file in its own child, alternating with the packer (A B A B ...). Samples are
random bytes of JPEG size; the shard stores them unchanged (no re-encoding). Prints one JSON line
per figure (../shared/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def sample_bytes(n: int, mean_mib: float) -> bytes:
    rng = random.Random(n)
    return rng.randbytes(int(mean_mib * MIB * rng.uniform(0.75, 1.25)))


# --- children: the measured processes ------------------------------------------------------------

def child_packer(config: dict[str, Any]) -> dict[str, Any]:
    """Pack `config["samples"]` as PackFunction would, in batches; report CPU, RSS and the shard."""
    sys.path[:0] = [config.get("functions", str(REPO / "functions"))]  # --before: another tree's packer
    from contracts.messages import Sample
    from core import aws
    from core.pack.packer import pack_samples, seal_due
    from core.pack.settings import PackSettings

    samples = [Sample.model_validate(s) for s in json.loads(Path(config["samples"]).read_text())]
    settings = PackSettings(table=config["table"], data_bucket=config["bucket"], event_bus="default",
                            shard_target_bytes=config["target"], shard_max_samples=len(samples),
                            shard_max_age_s=86400)
    batch = config["batch"]
    for service in ("s3", "dynamodb", "events"):  # a warm container: clients made by an earlier invocation
        aws.client(service)
    aws.transfer_client()
    start_cpu, start_wall = _cpu(), time.perf_counter()
    sealed, error = [], None
    try:
        for i in range(0, len(samples), batch):
            report = pack_samples([(f"m{j}", s) for j, s in enumerate(samples[i:i + batch], i)], settings)
            sealed += report.sealed
        sealed += seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    except Exception as failed:  # reported: moto itself can fail on very large completions
        error = repr(failed)[:300]
    cpu, wall = _cpu() - start_cpu, time.perf_counter() - start_wall
    return {"cpu_s": cpu, "wall_s": wall, "bytes": sum(s.size for s in sealed), "shards": len(sealed),
            "samples": sum(s.samples for s in sealed), "peak_rss_mib": _peak_rss_mib(), "error": error}


def child_tarwriter(config: dict[str, Any]) -> dict[str, Any]:
    """webdataset's TarWriter writing the same samples (already in memory) to a local file."""
    import webdataset as wds

    records = json.loads(Path(config["samples"]).read_text())
    images = [sample_bytes(n, config["image_mib"]) for n in range(len(records))]
    path = Path(config["out"])
    start_cpu, start_wall = _cpu(), time.perf_counter()
    with wds.TarWriter(str(path)) as sink:
        for record, image in zip(records, images):
            sink.write({"__key__": record["sha256"], "jpg": image, "json": json.dumps(record).encode(),
                        "txt": record["caption"]})
    cpu, wall = _cpu() - start_cpu, time.perf_counter() - start_wall
    size = path.stat().st_size
    path.unlink()
    return {"cpu_s": cpu, "wall_s": wall, "bytes": size, "peak_rss_mib": _peak_rss_mib()}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --- the driver ---------------------------------------------------------------------------------

class Moto:
    """moto in server mode, in its own process; objects spill to disk past 1 MiB."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(MIB)}
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(self.port)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def make_world(url: str, name: str, count: int, image_mib: float, pinned: bool) -> dict[str, Any]:
    """A table and a data bucket of its own, and `count` samples uploaded as ingest leaves them."""
    import boto3

    sys.path[:0] = [str(REPO / "functions")]
    from contracts.messages import Sample

    s3 = boto3.client("s3", endpoint_url=url)
    dynamodb = boto3.client("dynamodb", endpoint_url=url)
    uploads, data, table = f"bench-uploads-{image_mib}".replace(".", "-"), f"bench-data-{name}", f"bench-{name}"
    for bucket in (uploads, data):
        if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
            s3.create_bucket(Bucket=bucket)
            s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                          KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}])
    samples = []
    for n in range(count):
        image = sample_bytes(n, image_mib)
        key = f"partner-{'ab'[n % 2]}/bench/{n:05d}.jpg"
        head = _head(s3, uploads, key)
        version = head["VersionId"] if head and head["ContentLength"] == len(image) else \
            s3.put_object(Bucket=uploads, Key=key, Body=image)["VersionId"]
        import hashlib
        sha = hashlib.sha256(image).hexdigest()
        samples.append(Sample(
            sha256=sha, partner=key.split("/")[0], bucket=uploads, key=key, version_id=version if pinned else "",
            format="jpeg", width=4032, height=3024, size=len(image), caption=f"bench sample {n}",
            license="CC-BY-4.0", source="bench", uploaded_at="2026-11-29T12:00:00.000Z", aspect_bucket="4:3",
            content_bucket=uploads, content_key=key, content_sha256=sha).model_dump(mode="json"))
    path = Path(tempfile.mkdtemp()) / f"{name}.json"
    path.write_text(json.dumps(samples))
    return {"samples": str(path), "table": table, "bucket": data, "image_mib": image_mib}


def _head(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return s3.head_object(Bucket=bucket, Key=key)
    except Exception:
        return None


def run_child(kind: str, config: dict[str, Any], url: str) -> dict[str, Any]:
    env = {**os.environ, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "POWERTOOLS_LOG_LEVEL": "WARNING", "POWERTOOLS_SERVICE_NAME": "pack"}
    done = subprocess.run([sys.executable, __file__, f"--child-{kind}", json.dumps(config)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{kind} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def line(metric: str, value: float, unit: str, config: dict[str, Any], **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra, "config": config,
                      "commit": COMMIT, "machine": MACHINE, "versions": VERSIONS}), flush=True)


def main(args: argparse.Namespace) -> None:
    moto = Moto()
    try:
        # 1. CPU: the packer vs webdataset's TarWriter on the same samples, alternating.
        count = max(2, int(args.cpu_mib / args.image_mib))
        ours, verified, theirs, before = [], [], [], []
        for repeat in range(0 if args.skip_cpu else args.repeats + 1):  # the first round warms up and is dropped
            pinned = make_world(moto.url, f"cpu-{repeat}", count, args.image_mib, pinned=True)
            unpinned = make_world(moto.url, f"cpu-verified-{repeat}", count, args.image_mib, pinned=False)
            config = {**pinned, "target": 64 << 30, "batch": args.batch}
            a = run_child("packer", config, moto.url)
            b = run_child("tarwriter", {**pinned, "out": str(Path(tempfile.mkdtemp()) / "wds.tar")}, moto.url)
            c = run_child("packer", {**unpinned, "target": 64 << 30, "batch": args.batch}, moto.url)
            d = run_child("packer", {**make_world(moto.url, f"cpu-before-{repeat}", count, args.image_mib, pinned=True),
                                     "target": 64 << 30, "batch": args.batch, "functions": args.before},
                          moto.url) if args.before else None
            print(f"# round {repeat}: packer {a['bytes'] / 1e6 / a['cpu_s']:.0f} MB/cpu-s, "
                  f"TarWriter {b['bytes'] / 1e6 / b['cpu_s']:.0f}, verified {c['bytes'] / 1e6 / c['cpu_s']:.0f}"
                  + (f", before {d['bytes'] / 1e6 / d['cpu_s']:.0f}" if d else ""), file=sys.stderr, flush=True)
            if repeat:
                ours.append(a["bytes"] / 1e6 / a["cpu_s"])
                theirs.append(b["bytes"] / 1e6 / b["cpu_s"])
                verified.append(c["bytes"] / 1e6 / c["cpu_s"])
                if d:
                    before.append(d["bytes"] / 1e6 / d["cpu_s"])
        cpu_config = {"shard_mib": args.cpu_mib, "image_mib": args.image_mib, "samples": count, "batch": args.batch,
                      "repeats": args.repeats, "statistic": "median"}
        if ours:
            line("pack.mb_per_cpu_s", statistics.median(ours), "MB/cpu-s", cpu_config)
            line("pack.webdataset_mb_per_cpu_s", statistics.median(theirs), "MB/cpu-s", cpu_config,
                 baseline="webdataset.TarWriter to a local file, samples in memory")
            line("pack.ratio_vs_webdataset", statistics.median(o / t for o, t in zip(ours, theirs)), "ratio",
                 cpu_config, baseline="webdataset.TarWriter")
            line("pack.mb_per_cpu_s_verified", statistics.median(verified), "MB/cpu-s",
                 {**cpu_config, "note": "unpinned reads: every image re-hashed (sha256) against its record"})
        if before:
            line("pack.mb_per_cpu_s_before", statistics.median(before), "MB/cpu-s",
                 {**cpu_config, "note": f"the packer of {args.before}, same rounds (--before)"})
            line("pack.ratio_vs_before", statistics.median(o / b for o, b in zip(ours, before)), "ratio",
                 cpu_config, baseline=f"the packer of {args.before}")
        # 2. Peak RSS vs shard size.
        peaks: dict[int, float] = {}
        for size_mib in args.sizes_mib:
            count = max(1, int(size_mib / args.image_mib))
            world = make_world(moto.url, f"rss-{size_mib}", count, args.image_mib, pinned=True)
            result = run_child("packer", {**world, "target": 64 << 30, "batch": args.batch}, moto.url)
            peaks[size_mib] = result["peak_rss_mib"]
            print(f"# {size_mib} MiB: {result}", file=sys.stderr, flush=True)
            line(f"pack.peak_rss_mib_{_label(size_mib)}", result["peak_rss_mib"], "MiB",
                 {"shard_bytes": result["bytes"], "samples": result["samples"], "image_mib": args.image_mib,
                  "batch": args.batch, "cpu_s": round(result["cpu_s"], 2), "wall_s": round(result["wall_s"], 1),
                  **({"error": result["error"]} if result["error"] else {})})
        if 4096 in peaks and 100 in peaks:
            line("pack.rss_ratio_4gib_vs_100mib", peaks[4096] / peaks[100], "ratio", {"sizes_mib": [100, 4096]})
    finally:
        moto.stop()


def _label(size_mib: int) -> str:
    return f"{size_mib // 1024}gib" if size_mib % 1024 == 0 else f"{size_mib}mib"


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "functions", "bench"], cwd=REPO,
                           capture_output=True, text=True).stdout
    return head.strip() + ("+dirty" if dirty.strip() else "")


def _versions() -> dict[str, str]:
    from importlib.metadata import version
    return {name: version(name) for name in ("boto3", "moto", "webdataset", "aws-lambda-powertools")}


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    if len(sys.argv) == 3 and sys.argv[1].startswith("--child-"):
        kind, config = sys.argv[1].removeprefix("--child-"), json.loads(sys.argv[2])
        if os.environ.get("BENCH_PROFILE"):
            import cProfile
            profile = cProfile.Profile(time.process_time)
            profile.runcall(child_packer, config)
            profile.dump_stats(os.environ["BENCH_PROFILE"])
        print(json.dumps(child_packer(config) if kind == "packer" else child_tarwriter(config)))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image-mib", type=float, default=4.0, help="mean sample size")
    parser.add_argument("--cpu-mib", type=int, default=256, help="bytes of samples per CPU round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="samples per invocation (PackBatchSize)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[100, 1024, 4096])
    parser.add_argument("--skip-cpu", action="store_true", help="only the peak-RSS runs")
    parser.add_argument("--before", help="another tree's functions/ folder (e.g. `git archive HEAD functions`), "
                                         "whose packer runs in the same rounds")
    COMMIT, VERSIONS = _commit(), _versions()
    MACHINE = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": None}
    main(parser.parse_args())
