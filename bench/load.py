"""Load test: N uploads of mixed sizes through the local stack (moto, the Lambda-like workers).

Generates N distinct pictures first (JPEG/PNG/WebP, 64..256 px, `--large-share` of them 1,024..1,600
px; a third with sidecars), then uploads them as one partner as fast as one client can (or at
`--rate` per second), waits until every upload is quarantined or in a sealed shard, and audits.
Prints one JSON line per figure:
- load.uploads_per_s: N / (first upload -> last upload's sample sealed);
- load.p50_upload_to_shard_s, load.p99_upload_to_shard_s: from the end of an upload's PUT to the
  `sealed_at` of the shard that holds its sample (the index says which);
- load.lost, load.duplicated: the audit's violations (atelier.audit), plus any upload still pending;
- load.peak_rss_mib: peak RSS (VmHWM) of each runtime process (workers, moto), and their sum;
- load.dlq_messages: what the DLQs hold at the end.

    .venv/bin/python bench/load.py [--uploads 10000] [--rate 0] [--large-share 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

from atelier import client, dlq  # noqa: E402
from atelier.local import traffic  # noqa: E402
from atelier.local.stack import LocalStack, StackOptions  # noqa: E402
from contracts import pipeline_table
from core import aws
from atelier import audit

PARTNER = "load"
# samconfig.toml [local] and tuning/local.toml otherwise, whose pack settings (8 samples a batch and a shard) make the demo's
# 16 images two shards; here they would make 1,250 shards, each sealed by its own invocation. The load
# test packs as a partner's bulk upload would be packed: 100 samples an invocation, shards of up to
# 1,000 samples sealed within a minute. No training during the test.
OVERRIDES = {"TrainingQuota": "100000", "PackBatchSize": "100", "PackBatchWindowSeconds": "5"}
ENVIRONMENT = {"SHARD_MAX_SAMPLES": "1000", "SHARD_MAX_AGE_S": "60"}  # tuning knobs, over tuning/local.toml's
# A batch that fails returns after its queue's visibility timeout, 90 minutes for PackQueue: a minute
# here, so a retry shows in the latency instead of outlasting the run.
PROPERTIES = {"PackFunction": {"Timeout": 60}, "PackQueue": {"VisibilityTimeout": 60},
              "UploadsQueue": {"VisibilityTimeout": 60}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uploads", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=0.0, help="uploads per second; 0: as fast as one client can")
    parser.add_argument("--large-share", type=float, default=0.02)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--concurrency", type=int, default=StackOptions.concurrency,
                        help="worker processes a function at most (the local stack's cap on Lambda's concurrency)")
    args = parser.parse_args()
    revision = commit()  # the code that runs: read before the hour-long run, not after it
    made = traffic.uploads(PARTNER, args.uploads, seed=0, large_share=args.large_share, sidecar_share=0.3)
    config = {"uploads": args.uploads, "rate": args.rate or "unpaced", "large_share": args.large_share,
              "bytes": sum(len(u.body) for u in made), "sidecar_share": 0.3,
              "local_config": "samconfig.toml [local] + " + json.dumps(OVERRIDES) + ", tuning/local.toml + "
                              + json.dumps(ENVIRONMENT),
              "properties": PROPERTIES, "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory() as state:
        options = StackOptions(root=REPO, state_dir=Path(state), moto_port=0, sagemaker_port=0, overrides=OVERRIDES,
                               environment=ENVIRONMENT,
                               property_overrides=PROPERTIES, concurrency=args.concurrency)
        with LocalStack(options) as stack:
            aws.reset_clients()
            figures = drive(stack, made, args)
    for metric, value, unit, extra in figures:
        line(metric, value, unit, revision, config=config, **extra)


def drive(stack: LocalStack, made: list[traffic.Upload], args: argparse.Namespace) -> list[tuple]:
    outputs = stack.outputs
    client.add_partner(outputs, PARTNER, ["CC-BY-4.0"], [], "load test")
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    uploaded_at: dict[str, float] = {}
    started = time.time()
    for n, upload in enumerate(made):
        if args.rate:
            time.sleep(max(0.0, started + n / args.rate - time.time()))
        traffic.put(outputs["UploadsBucketName"], upload)
        uploaded_at[upload.key] = time.time()
        if n % 1000 == 999:
            print(f"[{time.time() - started:6.0f} s] {n + 1} uploaded", file=sys.stderr, flush=True)
    queues = [outputs["UploadsQueueUrl"], outputs["PackQueueUrl"]]
    targets = audit.Targets(outputs["UploadsBucketName"], outputs["DataBucketName"], outputs["PipelineTableName"])

    def settled() -> bool:
        depths = [traffic.queue_depth([url]) for url in queues]
        if any(depths):
            print(f"[{time.time() - started:6.0f} s] queued: uploads {depths[0]}, pack {depths[1]}", file=sys.stderr,
                  flush=True)
            return False
        report = audit.gather(targets, since, datetime.now(timezone.utc) + timedelta(minutes=5), 1e9, verify_bytes=False)
        print(f"[{time.time() - started:6.0f} s] {len(report.pending)} pending", file=sys.stderr, flush=True)
        return not report.pending

    traffic.wait_until(settled, args.timeout_s, every_s=5, check=stack.check)
    rss = peak_rss(stack)
    report = audit.gather(targets, since, datetime.now(timezone.utc) + timedelta(minutes=5), 1e9)
    latencies, last_sealed = upload_to_shard(outputs, uploaded_at)
    dead = {name: len(traffic.receive_all(url)) for name, url in dlq.queues(outputs).items()}
    lost = sum(v.kind == "lost" for v in report.violations) + len(report.pending)
    duplicated = sum(v.kind == "duplicated" for v in report.violations)
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    facts = {"accepted": report.accepted, "quarantined": report.quarantined, "shards": report.shards,
             "violations": len(report.violations), "pending": len(report.pending)}
    return [
        ("load.uploads_per_s", len(made) / (last_sealed - started), "uploads/s",
         {"wall_s": round(last_sealed - started, 1), **facts}),
        ("load.p50_upload_to_shard_s", statistics.median(latencies), "s", {"samples": len(latencies)}),
        ("load.p99_upload_to_shard_s", quantiles[98], "s", {"samples": len(latencies), "max_s": round(max(latencies), 2)}),
        ("load.lost", lost, "uploads", {"audit_ok": report.ok}),
        ("load.duplicated", duplicated, "samples", {"audit_ok": report.ok}),
        ("load.peak_rss_mib", sum(rss.values()), "MiB", {"per_process_mib": rss, "note": "sum of each process's peak"}),
        ("load.dlq_messages", sum(dead.values()), "messages", {"per_dlq": dead}),
    ]


def upload_to_shard(outputs: dict[str, str], uploaded_at: dict[str, float]) -> tuple[list[float], float]:
    """Seconds from each accepted upload's PUT to its shard's sealed_at; the last sealed_at."""
    bucket, table = outputs["UploadsBucketName"], outputs["PipelineTableName"]
    found = aws.batch_get_items(table, [pipeline_table.upload_pk(bucket, k) for k in uploaded_at])
    sha_of = {pk.removeprefix(pipeline_table.upload_pk(bucket, "")): item.get("sha256") for pk, item in found.items()
              if item.get("status") == "accepted"}
    sealed_at: dict[str, float] = {}
    for shard in traffic.sealed(table):
        index = aws.read_json_if_exists(shard.bucket, shard.index_key) or {"samples": []}
        when = datetime.fromisoformat(shard.sealed_at).timestamp()
        sealed_at.update({s["key"]: when for s in index["samples"]})
    latencies = [sealed_at[sha] - uploaded_at[key] for key, sha in sha_of.items() if sha in sealed_at]
    return latencies, max(sealed_at.values())


def peak_rss(stack: LocalStack) -> dict[str, float]:
    """VmHWM of the workers and moto (each process's own peak), in MiB."""
    processes = {"moto": stack.moto, **stack.workers}
    peaks = {}
    for name, process in processes.items():
        if process is None:
            continue
        for row in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if row.startswith("VmHWM:"):
                peaks[name] = round(int(row.split()[1]) / 1024, 1)
    return peaks


def line(metric: str, value: float, unit: str, revision: str, **context: object) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, "commit": revision,
                      "machine": {"nproc": os.cpu_count(), "gpu": None},
                      "versions": {p: version(p) for p in ("moto", "boto3", "aws-lambda-powertools")}, **context}),
          flush=True)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return f"{head}+dirty" if dirty else head


if __name__ == "__main__":
    main()
