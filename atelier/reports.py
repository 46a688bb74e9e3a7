"""Reports for people: what became of one partner's uploads, and a training job's HTML report.

Both read what the pipeline already records (the table, the job's S3 output) through AWS APIs.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from collections import Counter, defaultdict
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import boto3
from botocore.exceptions import ClientError

from atelier.client import PipelineError
from core import aws

REPORT_NAME = "report.html"  # trainer/report.py's REPORT
RECORD_NAME = "atelier-training.json"  # the run's record in the model artefact (history, steps)
AFTER_TRAINING = ("evaluation.json", "lineage.json")  # written beside the artefact by deploy / start-training


def partner_report(outputs: dict[str, str], partner: str) -> dict[str, Any]:
    """Every upload of `partner`: accepted or rejected (why), the shard it is in, the jobs that trained on it."""
    uploads, samples, shards, jobs = [], {}, {}, []
    bucket_prefix = f"UPLOAD#{outputs['UploadsBucketName']}/"
    for item in aws.scan(outputs["PipelineTableName"]):
        kind = item.get("kind")
        if kind == "upload" and item.get("partner") == partner:
            uploads.append(item)
        elif kind == "sample" and item.get("partner") == partner:
            samples[item["pk"].removeprefix("SAMPLE#")] = item.get("packed_in")
        elif kind == "shard":
            shards[item["pk"].removeprefix("SHARD#")] = item
        elif kind == "job":
            jobs.append(item)
    jobs_of_shard: dict[str, list[str]] = defaultdict(list)
    for job in sorted(jobs, key=lambda j: j.get("at", "")):
        for shard_id in [*job.get("shards", []), *job.get("replay", [])]:
            jobs_of_shard[shard_id].append(job["pk"].removeprefix("JOB#"))
    items = []
    for upload in sorted(uploads, key=lambda u: u["pk"]):
        shard = samples.get(upload.get("sha256") or "") if upload["status"] == "accepted" else None
        items.append({"key": upload["pk"].removeprefix(bucket_prefix), "status": upload["status"],
                      "reason": upload.get("reason"), "detail": upload.get("detail"), "sha256": upload.get("sha256"),
                      "uploaded_at": upload.get("at"), "shard": shard, "jobs": jobs_of_shard.get(shard or "", [])})
    used_shards = sorted({i["shard"] for i in items if i["shard"]})
    used_jobs = {name for shard in used_shards for name in jobs_of_shard.get(shard, [])}
    return {
        "partner": partner,
        "uploads": len(items),
        "accepted": sum(i["status"] == "accepted" for i in items),
        "rejected": dict(Counter(i["reason"] or "unknown" for i in items if i["status"] == "quarantined")),
        "packed": sum(bool(i["shard"]) for i in items),
        "shards": [{"shard": s, "status": shards.get(s, {}).get("status", "packing"),
                    "samples": sum(i["shard"] == s for i in items), "jobs": jobs_of_shard.get(s, [])}
                   for s in used_shards],
        "jobs": [{"job": j["pk"].removeprefix("JOB#"), "status": j.get("status"), "model": j.get("model_data") or None}
                 for j in sorted(jobs, key=lambda j: j.get("at", "")) if j["pk"].removeprefix("JOB#") in used_jobs],
        "items": items,
    }


def job_report(outputs: dict[str, str], job: str) -> bytes:
    """The job's report.html, rebuilt with what arrived after training (the gate's decision in
    `evaluation.json`, `lineage.json`, both beside the artefact) when the run's record is there;
    else the page the trainer wrote."""
    bucket, prefix = outputs["ModelsBucketName"], f"training/{job}/output/"
    with tempfile.TemporaryDirectory() as folder:
        model_dir, health_dir = Path(folder, "model"), Path(folder, "health")
        _extract(bucket, f"{prefix}output.tar.gz", health_dir, lambda name: name == REPORT_NAME or name.startswith("validation/"))
        _extract(bucket, f"{prefix}model.tar.gz", model_dir, lambda name: name == RECORD_NAME, stop_after=RECORD_NAME)
        for name in AFTER_TRAINING:
            document = aws.read_json_if_exists(bucket, prefix + name)
            if document is not None:
                (model_dir / name).write_text(json.dumps(document))
        if (model_dir / RECORD_NAME).is_file():
            from trainer.report import build  # the trainer's own page (standard library only)
            return build(model_dir, health_dir, job=job).encode()
        if (health_dir / REPORT_NAME).is_file():
            return (health_dir / REPORT_NAME).read_bytes()
    raise PipelineError(f"no {REPORT_NAME} for job {job!r} under s3://{bucket}/{prefix}: "
                        "has it finished? (`atelier status` lists jobs)")


def _extract(bucket: str, key: str, folder: Path, wanted: Callable[[str], bool], stop_after: str | None = None) -> None:
    """The wanted members of a gzipped tar in S3, read front to back; nothing when it is absent."""
    try:
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("NoSuchKey", "404", "AccessDenied"):
            return
        raise
    with tarfile.open(fileobj=body, mode="r|gz") as tar:
        for member in tar:
            name = str(PurePosixPath(member.name.removeprefix("./")))
            if not member.isfile() or not wanted(name) or ".." in PurePosixPath(name).parts:
                continue
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            extracted = tar.extractfile(member)
            target.write_bytes(extracted.read() if extracted else b"")
            if name == stop_after:
                return


def report_from_tar(stream: Any) -> bytes | None:
    """The first report.html in a gzipped tar read front to back (nothing is written to disk)."""
    with tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            if member.isfile() and PurePosixPath(member.name).name == REPORT_NAME:
                extracted = tar.extractfile(member)
                return extracted.read() if extracted else None
    return None
