"""Benchmark pack lanes: packing throughput at PackLanes = 1, 2, 4 on the local stack, side by side.

    .venv/bin/python bench/pack_lanes.py                                  # the recorded run
    .venv/bin/python bench/pack_lanes.py --samples 40 --repeats 1         # a quick look

Each run (one lane count N, one round) starts from nothing, as `atelier local up` would: moto as
the local stack runs it (`python -m atelier.local.moto_server`), template.yaml's resources
provisioned with PackLanes=N (atelier.local.provision), and M samples left as ingest leaves them
(the image in the uploads bucket, pinned by its version, and its SAMPLE record with its lane). Then
as many packer processes as the template lets PackFunction run at once for N (Mappings
PackLaneConcurrency: 2 x N) take batches from one queue and call `pack_samples`, as concurrent
invocations do; once all are done, one of them calls `seal_due` at maximum age 0 (the seal timer;
`--final-seal every`: each of them). A failed invocation comes back after about `--redelivery-s`,
as SQS would redeliver its batch, at most 5 times, and is counted. The clock runs from the release
of the warmed processes to the last one's return, so sealing is included.

After each run every sample must be in exactly one sealed shard (the sealed records and their
indexes), marked `packed_in` that shard, every shard of one lane, every head empty and every seal
done; otherwise the bench stops. Rounds alternate the order of N (1 2 4, then 4 2 1, ...); figures are
medians over rounds, the ratios medians of each round's ratio. moto's CPU (from /proc) is reported
in cores, next to the packers' own CPU and the machine's busy share, to show what bounds the figure.
Prints one JSON line per figure (../shared/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

from bench.pack_lanes_stack import REGION, Moto, Role, packer_process, provision, upload_samples  # noqa: E402
from contracts import pipeline_table  # noqa: E402
from contracts.messages import Sample, ShardSealed  # noqa: E402
from core import aws  # noqa: E402
from core.pack import journal, lanes  # noqa: E402
from core.pack.settings import PackSettings  # noqa: E402


# --- one run ----------------------------------------------------------------------------------------

def run(lane_count: int, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh stack with N lanes, M samples, the packers: what they did, timed, and checked."""
    with tempfile.TemporaryDirectory(prefix="pack-lanes-") as folder:
        moto = Moto(Path(folder))
        try:
            settings, processes, outputs = provision(moto.url, lane_count, args)
            samples = upload_samples(outputs, lane_count, args)
            samples_path = Path(folder) / "samples.json"
            samples_path.write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
            result = drive(settings, str(samples_path), len(samples), processes, args, moto)
            result.update(check(settings, samples, result.pop("reports")), moto_5xx=moto.server_errors(),
                          processes=processes, samples=len(samples), bytes=sum(s.size for s in samples))
        finally:
            moto.stop()
    return result


def drive(settings: PackSettings, samples_path: str, count: int, processes: int, args: argparse.Namespace,
          moto: Moto) -> dict[str, Any]:
    """Start the packers, release them together, and wait for every report."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters, as Lambda's environments are
    work, results = context.Queue(), context.Queue()
    start, done = context.Barrier(processes + 1), context.Barrier(processes)
    for first in range(0, count, args.batch):
        work.put((first, min(first + args.batch, count)))
    for _ in range(processes):
        work.put(None)
    roles = [Role(seals=args.final_seal == "every" or n == 0, strict=args.strict, redelivery_s=args.redelivery_s)
             for n in range(processes)]
    children = [context.Process(target=packer_process, args=(settings, samples_path, work, results, (start, done), role))
                for role in roles]
    for child in children:
        child.start()
    reports: list[dict[str, Any]] = []
    try:
        start.wait(timeout=300)
        began, moto_cpu, machine = time.perf_counter(), moto.cpu_s(), _machine_ticks()
        while len(reports) < processes:
            try:
                reports.append(results.get(timeout=1))
            except queue.Empty:
                if time.perf_counter() - began > args.timeout_s:
                    raise RuntimeError(f"packers still running after {args.timeout_s} s") from None
                if any(c.exitcode not in (None, 0) for c in children):
                    raise RuntimeError(f"a packer died: exit codes {[c.exitcode for c in children]}") from None
        wall = time.perf_counter() - began
        moto_cpu, machine = moto.cpu_s() - moto_cpu, _busy_share(machine, _machine_ticks())
    finally:
        for child in children:
            child.join(timeout=30 if len(reports) == processes else 0)
            if child.is_alive():
                child.terminate()
    errors = [r["error"] for r in reports if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} packer(s) failed; the first:\n{errors[0]}")
    return {"wall_s": wall, "moto_cpu_cores": moto_cpu / wall, "machine_busy_share": machine,
            "packers_cpu_s": sum(r["cpu_s"] for r in reports), "reports": reports,
            "lost_commit_races": sum(r["races"] for r in reports),
            "contention_retries": sum(r["contention_retries"] for r in reports),
            "failures": [f for r in reports for f in r["failures"]],
            "redelivery_wait_s": sum(r["redelivery_wait_s"] for r in reports),
            "committed": sum(r["committed"] for r in reports), "already_packed": sum(r["already_packed"] for r in reports),
            "failed": sum(r["failed"] for r in reports), "packer_problems": [p for r in reports for p in r["problems"]]}


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def check(settings: PackSettings, samples: list[Sample], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every sample in exactly one sealed shard, marked so, of one lane; heads empty, seals done. Raises otherwise."""
    problems: list[str] = []
    sealed = [ShardSealed.model_validate_json(i["record"])
              for i in aws.scan_prefix(settings.table, pipeline_table.SEALED_PREFIX)]
    shards_of: dict[str, list[str]] = defaultdict(list)
    for shard in sealed:
        index = aws.read_json_if_exists(shard.bucket, shard.index_key)
        if index is None:
            problems.append(f"{shard.shard_id}: no index")
            continue
        keys = [entry["key"] for entry in index["samples"]]
        head = aws.head_object(shard.bucket, shard.key)
        if len(keys) != shard.samples or not head or head["ContentLength"] != shard.size:
            problems.append(f"{shard.shard_id}: {len(keys)} indexed, {shard.samples} recorded, "
                            f"object {head and head['ContentLength']} bytes, recorded {shard.size}")
        if len({lanes.lane_of(k, settings.lanes) for k in keys}) > 1:
            problems.append(f"{shard.shard_id}: samples of several lanes")
        for key in keys:
            shards_of[key].append(shard.shard_id)
    expected = {s.sha256 for s in samples}
    missing, extra = expected - shards_of.keys(), shards_of.keys() - expected
    twice = [k for k, ids in shards_of.items() if len(ids) > 1]
    marks = aws.batch_get_items(settings.table, [pipeline_table.sample_pk(k) for k in expected], ["pk", "packed_in"])
    unmarked = [k for k in expected - missing
                if marks.get(pipeline_table.sample_pk(k), {}).get("packed_in") != shards_of[k][0]]
    for label, found in (("not in any sealed shard", missing), ("sealed but not a sample", extra),
                         ("in more than one sealed shard", twice), ("packed_in is not its shard", unmarked)):
        if found:
            problems.append(f"{len(found)} samples {label}, e.g. {sorted(found)[:3]}")
    busy = [h.lane for h in journal.load_heads(settings.table, lanes.MAX_LANES) if h.open or h.pending or h.sealing]
    unfinished = [i["pk"] for i in aws.scan_prefix(settings.table, pipeline_table.PACK_SHARD_PREFIX)
                  if i.get("status") != "done"]
    if busy or unfinished:
        problems.append(f"heads still open, pending or sealing: lanes {busy}; seals not done: {unfinished}")
    # A shard announced by an invocation that failed afterwards (sealing the next shard) is not in its
    # report: its seal_due raised. The event went out all the same; the redelivery finds the seal done.
    announced = Counter(shard_id for r in reports for shard_id, _, _ in r["sealed"])
    if not set(announced) <= {s.shard_id for s in sealed}:
        problems.append(f"announced {sorted(announced)} but the sealed records hold {sorted(s.shard_id for s in sealed)}")
    if problems:
        raise SystemExit("pack lanes: the packed result is wrong:\n  " + "\n  ".join(problems))
    return {"shards": len(sealed), "shard_bytes": sum(s.size for s in sealed),
            "announced_twice": sum(1 for n in announced.values() if n > 1),
            "announced_in_failed_invocations": len(sealed) - len(announced),
            "shard_samples": sorted(s.samples for s in sealed)}


# --- the driver ---------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "bench"
    os.environ.update(AWS_DEFAULT_REGION=REGION, AWS_REGION=REGION, POWERTOOLS_SERVICE_NAME="pack")
    os.environ.pop("POWERTOOLS_METRICS_NAMESPACE", None)  # no EMF lines: core.telemetry records nothing
    runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for round_ in range(args.repeats):
        for lane_count in (args.lanes if round_ % 2 == 0 else args.lanes[::-1]):
            result = run(lane_count, args)
            result["mb_per_s"] = result["bytes"] / 1e6 / result["wall_s"]
            runs[lane_count].append(result)
            print(f"# round {round_} N={lane_count}: {result['mb_per_s']:.1f} MB/s, {result['wall_s']:.1f} s, "
                  f"{result['shards']} shards, {result['lost_commit_races']} lost races, "
                  f"{len(result['failures'])} failed invocations, "
                  f"moto {result['moto_cpu_cores']:.2f} cores, machine busy {result['machine_busy_share']:.2f}",
                  file=sys.stderr, flush=True)
    common = {"image_kib": args.image_kib, "batch": args.batch, "shard_target_mib": args.shard_mib,
              "min_part_bytes": PackSettings.min_part_bytes, "part_bytes": PackSettings.part_bytes,
              "rounds": args.repeats, "statistic": "median over rounds", "order": "rounds alternate: N ascending, descending",
              "final_seal": args.final_seal, "redelivery_s": args.redelivery_s}
    for lane_count, results in runs.items():
        config = {**common, "lanes": lane_count, **_described(results)}
        value = statistics.median(r["mb_per_s"] for r in results)
        line(f"pack.lanes_mb_per_s_n{lane_count}", value, "MB/s", config)
        line(f"pack.lanes_mb_per_s_per_lane_n{lane_count}", value / lane_count, "MB/s", config)
    for lane_count in (n for n in runs if n != 1 and 1 in runs):
        ratios = [r["mb_per_s"] / b["mb_per_s"] for r, b in zip(runs[lane_count], runs[1])]
        line(f"pack.lanes_ratio_n{lane_count}_vs_n1", statistics.median(ratios), "ratio",
             {**common, "lanes": lane_count, "per_round": [round(r, 3) for r in ratios]},
             baseline="the same bench at PackLanes=1, same rounds")


def _described(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What the runs of one N did: the same in every round, or each round's value."""
    first = results[0]
    return {
        "samples": first["samples"], "bytes": first["bytes"], "processes": first["processes"],
        "mb_per_s_per_round": [round(r["mb_per_s"], 1) for r in results],
        "wall_s": [round(r["wall_s"], 1) for r in results],
        "lost_commit_races": [r["lost_commit_races"] for r in results],
        "contention_retries": [r["contention_retries"] for r in results],
        "failed_invocations": [len(r["failures"]) for r in results],
        "failures": dict(Counter(_kind(f) for r in results for f in r["failures"])),
        "moto_cpu_cores": [round(r["moto_cpu_cores"], 2) for r in results],
        "packers_cpu_cores": [round(r["packers_cpu_s"] / r["wall_s"], 2) for r in results],
        "machine_busy_share": [round(r["machine_busy_share"], 2) for r in results],
        "shards": [r["shards"] for r in results], "shard_bytes": [r["shard_bytes"] for r in results],
        "moto_5xx": [r["moto_5xx"] for r in results], "announced_twice": [r["announced_twice"] for r in results],
        "announced_in_failed_invocations": [r["announced_in_failed_invocations"] for r in results],
        "redelivery_wait_s": [round(r["redelivery_wait_s"], 1) for r in results],
        "packer_problems": sum(len(r["packer_problems"]) for r in results),
        "checked": "every sample in exactly one sealed shard, packed_in marks, one lane a shard, heads empty",
    }


def _kind(failure: str) -> str:
    """A failure without its ids (upload ids, keys), so that alike ones count together."""
    return re.sub(r"\b(?=[\w-]*\d)[\w-]{20,}", "<id>", failure)


def line(metric: str, value: float, unit: str, config: dict[str, Any], **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra, "config": config,
                      "commit": COMMIT, "machine": MACHINE, "versions": VERSIONS}), flush=True)


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "functions", "atelier", "template.yaml"], cwd=REPO,
                           capture_output=True, text=True).stdout
    return head.strip() + ("+dirty" if dirty.strip() else "")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4], help="PackLanes values to compare")
    parser.add_argument("--samples", type=int, default=400, help="samples per run (M)")
    parser.add_argument("--image-kib", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"),
                        help="image sizes, uniform between MIN and MAX KiB")
    parser.add_argument("--batch", type=int, default=64, help="samples per invocation (PackBatchSize)")
    parser.add_argument("--shard-mib", type=int, default=64, help="SHARD_TARGET_BYTES, in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every N once")
    parser.add_argument("--strict", action="store_true", help="stop at a packer's first failed invocation")
    parser.add_argument("--redelivery-s", type=float, default=1.0,
                        help="mean wait before a failed batch is packed again (PackQueue's visibility timeout, shortened)")
    parser.add_argument("--final-seal", choices=("timer", "every"), default="timer",
                        help="once every packer is done: one seal_due at age 0 (the timer), or one by every packer")
    parser.add_argument("--timeout-s", type=float, default=600, help="longest one run's packing may take")
    COMMIT = _commit()  # the code that runs: read before the run, not after it
    VERSIONS = {name: version(name) for name in ("boto3", "moto", "aws-lambda-powertools")}
    MACHINE = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": None}
    main(parser.parse_args())
