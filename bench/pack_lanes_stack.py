"""What bench/pack_lanes.py runs: packer processes, each one of PackFunction's concurrent invocations, and
the local stack they pack on (moto as `atelier local up` runs it, template.yaml provisioned with PackLanes=N,
samples left as ingest leaves them).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import resource
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from contracts import pipeline_table
from contracts.aspect_buckets import aspect_bucket
from contracts.messages import Sample
from core import aws
from core.pack import lanes
from core.pack.settings import PackSettings

REPO = Path(__file__).resolve().parents[1]
KIB, MIB = 1 << 10, 1 << 20
REGION, ACCOUNT, STACK = "us-east-1", "123456789012", "atelier"
RACE = "another packer committed first; retrying"  # core.pack.packer's line for a lost commit
WIDTH, HEIGHT = 1024, 768
ATTEMPTS = 5  # PackQueue's maxReceiveCount: a batch failing this often would go to the DLQ, and the bench stops
T = TypeVar("T")


# --- a packer process: one of PackFunction's concurrent invocations ------------------------------

class LogTally(logging.Handler):
    """Counts the packer's lost commit races; keeps (and prints) its warnings and errors."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.races = 0
        self.problems: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == RACE:
            self.races += 1
        elif record.levelno >= logging.WARNING:
            extra = {k: v for k, v in vars(record).items() if k in ("sha256", "shard", "error")}
            self.problems.append(f"{record.name}: {record.getMessage()} {extra}")
            print(f"# packer {os.getpid()}: {self.problems[-1]}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Role:
    seals: bool  # this process makes the final seal_due call (the timer's), after every packer is done
    strict: bool  # a failed invocation stops the bench, instead of coming back as a redelivery
    redelivery_s: float  # the mean wait before a failed batch comes back (the visibility timeout, shortened)


def packer_process(settings: PackSettings, samples_path: str, work: Any, results: Any, gates: tuple[Any, Any],
                   role: Role) -> None:
    """Take batches until the sentinel and pack each; wait for the others; then the timer's seal if
    `role.seals`. Reports counts and this process's own CPU."""
    sys.stdout = sys.stderr  # the parent's stdout carries the JSON lines only
    from aws_lambda_powertools import Logger

    from core.pack.packer import pack_samples, seal_due

    tally = LogTally()
    Logger(service="pack", logger_handler=tally)  # PackFunction's service logger; the packer's are its children
    samples = [Sample.model_validate(s) for s in json.loads(Path(samples_path).read_text())]
    for service in ("s3", "dynamodb", "events"):  # a warm container: clients made by an earlier invocation
        aws.client(service)
    aws.transfer_client()
    report: dict[str, Any] = {"pid": os.getpid(), "batches": 0, "contention_retries": 0, "failures": [],
                              "redelivery_wait_s": 0.0,
                              "committed": 0, "already_packed": 0, "failed": 0, "sealed": [], "error": None}
    start, done = gates
    start.wait()
    cpu = _own_cpu()
    try:
        while (batch := work.get()) is not None:
            messages = [(f"m{n}", samples[n]) for n in range(*batch)]
            packed = _invoke(lambda: pack_samples(messages, settings), report, role)
            report["batches"] += 1
            report["committed"] += packed.committed
            report["already_packed"] += packed.already_packed
            report["failed"] += len(packed.failed)
            report["sealed"] += [(s.shard_id, s.size, s.samples) for s in packed.sealed]
        done.wait()
        if role.seals:
            final = _invoke(lambda: seal_due(dataclasses.replace(settings, shard_max_age_s=0)), report, role)
            report["sealed"] += [(s.shard_id, s.size, s.samples) for s in final]
    except Exception:  # reported to the driver, which stops the bench with it
        report["error"] = traceback.format_exc()[-3000:]
        done.abort()
    report.update(cpu_s=_own_cpu() - cpu, races=tally.races, problems=tally.problems)
    results.put(report)


def _invoke(call: Callable[[], T], report: dict[str, Any], role: Role) -> T:
    """One invocation and, while it fails (PackContention included), its redeliveries: ATTEMPTS in all."""
    from core.pack.packer import PackContention

    for _ in range(ATTEMPTS - 1):
        try:
            return call()
        except PackContention:
            report["contention_retries"] += 1
        except Exception as failed:
            if role.strict:
                raise
            report["failures"].append(f"{type(failed).__name__}: {str(failed)[:160]}")
            print(f"# packer {os.getpid()}: invocation failed, its batch comes back: {report['failures'][-1]}",
                  file=sys.stderr, flush=True)
        wait = random.uniform(0.5, 1.5) * role.redelivery_s
        report["redelivery_wait_s"] += wait
        time.sleep(wait)
    return call()


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the local stack ------------------------------------------------------------------------------

class Moto:
    """`python -m atelier.local.moto_server`, as atelier.local.stack starts it; its log keeps the
    requests answered with an error (4xx, 5xx), which are all it logs."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.log = folder / "moto.log"
        self.sink = self.log.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "atelier.local.moto_server", "127.0.0.1", str(port)],
                                        stdout=self.sink, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto did not start; see {self.log}") from None
                time.sleep(0.2)

    def cpu_s(self) -> float:
        """user + system seconds of the server process so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def server_errors(self) -> int:
        """Requests answered 5xx (a 4xx is a failed condition or a missing key: the protocol's own answers)."""
        return sum(1 for row in self.log.read_text(errors="replace").splitlines()
                   if re.search(r'" 5\d\d ', row))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sink.close()


def provision(url: str, lane_count: int, args: argparse.Namespace) -> tuple[PackSettings, int, dict[str, str]]:
    """template.yaml into moto with PackLanes=N: PackFunction's settings, its concurrency, the outputs."""
    import boto3

    from atelier.local.provision import Provisioner
    from atelier.local.template import expand, load_overrides, set_environment

    os.environ["AWS_ENDPOINT_URL"] = url
    aws.reset_clients()
    overrides = {**load_overrides(REPO / "samconfig.toml", "local"), "PackLanes": str(lane_count),
                 "PackBatchSize": str(args.batch)}
    expanded = expand(REPO / "template.yaml", overrides, STACK, REGION, ACCOUNT)
    set_environment(expanded, {"SHARD_TARGET_BYTES": str(args.shard_mib * MIB), "SHARD_MAX_SAMPLES": "10000",
                               "SHARD_MAX_AGE_S": "3600"})
    provisioned = Provisioner(expanded, STACK, REGION, ACCOUNT, boto3.session.Session(region_name=REGION).client).provision()
    settings = PackSettings.from_env(provisioned.functions["PackFunction"].environment)
    mapping = next(s for s in provisioned.sources if s.function == "PackFunction" and s.kind == "sqs")
    if settings.lanes != lane_count or not mapping.max_concurrency:
        raise RuntimeError(f"the template gave {settings.lanes} lanes, concurrency {mapping.max_concurrency}")
    return settings, mapping.max_concurrency, provisioned.outputs


def image_of(n: int, args: argparse.Namespace) -> bytes:
    rng = random.Random(n)
    return rng.randbytes(rng.randint(args.image_kib[0] * KIB, args.image_kib[1] * KIB))


def upload_samples(outputs: dict[str, str], lane_count: int, args: argparse.Namespace) -> list[Sample]:
    """M accepted samples as ingest leaves them: the image (a pinned version) and its SAMPLE record,
    which holds the lane ingest chose (core.ingest.admission)."""
    bucket, table = outputs["UploadsBucketName"], outputs["PipelineTableName"]

    def upload(n: int) -> Sample:
        image = image_of(n, args)
        key = f"partner-{'ab'[n % 2]}/bench/{n:05d}.jpg"
        version_id = aws.put_bytes(bucket, key, image, "image/jpeg", checksum=False)
        sha = hashlib.sha256(image).hexdigest()
        sample = Sample(sha256=sha, partner=key.split("/", 1)[0], bucket=bucket, key=key, version_id=version_id,
                        format="jpeg", width=WIDTH, height=HEIGHT, size=len(image), caption=f"bench sample {n}",
                        license="CC-BY-4.0", source="bench", uploaded_at="2026-12-02T12:00:00.000Z",
                        aspect_bucket=aspect_bucket(WIDTH, HEIGHT), content_bucket=bucket, content_key=key,
                        content_sha256=sha)
        aws.put_item(table, pipeline_table.sample_item(sample, pack_lane=lanes.lane_of(sha, lane_count)))
        return sample

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(upload, range(args.samples)))
