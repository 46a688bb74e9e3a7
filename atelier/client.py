"""What the CLI does against a deployed pipeline, through AWS APIs only (real AWS or the local stack).

Resource names come from the CloudFormation stack's outputs, as `sam deploy` leaves them (the
local stack registers the same outputs).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import boto3
from botocore.exceptions import ClientError

from core import aws
from core.uploads import PARTNER_PATTERN, SIDECAR_SUFFIX

if TYPE_CHECKING:
    from core.licensing import Partner


class PipelineError(RuntimeError):
    """A user-facing failure with a message that says what to do."""


def stack_outputs(stack: str) -> dict[str, str]:
    try:
        described = boto3.client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0]
    except ClientError as exc:
        raise PipelineError(f"stack {stack!r} not found ({exc.response['Error']['Message']}); "
                           "deploy it with `sam deploy`, or start `atelier local up` and pass --local") from exc
    return {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}


# --- upload -------------------------------------------------------------------------------------

def files_to_upload(path: Path) -> list[Path]:
    """Sidecars first, so an image's caption and license are there when its event is handled."""
    if path.is_file():
        files = [path]
        sidecar = path.with_suffix(SIDECAR_SUFFIX)
        if sidecar.exists() and sidecar != path:
            files.insert(0, sidecar)
        return files
    if not path.is_dir():
        raise PipelineError(f"{path} is neither a file nor a folder")
    every = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [p for p in every if p.suffix == SIDECAR_SUFFIX] + [p for p in every if p.suffix != SIDECAR_SUFFIX]


def upload(path: Path, partner: str, bucket: str) -> Iterator[str]:
    """Upload a file or a folder under `<partner>/`, yielding each key as it is written."""
    if not PARTNER_PATTERN.fullmatch(partner):
        raise PipelineError(f"partner id {partner!r} must be lower-case letters, digits and '-' (at most 64)")
    s3 = boto3.client("s3")
    root = path if path.is_dir() else path.parent
    for file in files_to_upload(path):
        key = f"{partner}/{file.relative_to(root).as_posix()}"
        s3.upload_file(str(file), bucket, key)
        yield key


# --- partners -----------------------------------------------------------------------------------

def add_partner(outputs: dict[str, str], partner_id: str, licenses: list[str], prefixes: list[str],
                terms: str) -> "Partner":
    """Register (or replace) a partner and the licenses it grants."""
    from core.licensing import Partner, put_partner
    if not PARTNER_PATTERN.fullmatch(partner_id):
        raise PipelineError(f"partner id {partner_id!r} must be lower-case letters, digits and '-' (at most 64)")
    if not licenses:
        raise PipelineError("a partner needs at least one --license")
    return put_partner(outputs["PipelineTableName"], Partner(
        partner_id=partner_id, licenses=tuple(licenses), prefixes=tuple(prefixes or [""]), terms=terms))


def partners(outputs: dict[str, str]) -> list["Partner"]:
    from core.licensing import list_partners
    return list_partners(outputs["PipelineTableName"])


# --- generate -----------------------------------------------------------------------------------

def generate(endpoint: str, prompt: str, seed: int, steps: int) -> bytes:
    body = json.dumps({"prompt": prompt, "seed": seed, "num_inference_steps": steps})
    try:
        response = boto3.client("sagemaker-runtime").invoke_endpoint(
            EndpointName=endpoint, ContentType="application/json", Accept="image/png", Body=body)
    except ClientError as exc:
        raise PipelineError(f"endpoint {endpoint!r}: {exc.response['Error'].get('Message', exc)}") from exc
    return response["Body"].read()


# --- status -------------------------------------------------------------------------------------

@dataclass
class Status:
    uploads: Counter[str] = field(default_factory=Counter)
    quarantined: Counter[str] = field(default_factory=Counter)
    samples: int = 0
    packed: int = 0
    shards: Counter[str] = field(default_factory=Counter)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    endpoints: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"uploads": dict(self.uploads), "quarantined": dict(self.quarantined), "samples": self.samples,
                "packed": self.packed, "shards": dict(self.shards), "jobs": self.jobs, "endpoints": self.endpoints}


def pipeline_status(outputs: dict[str, str]) -> Status:
    status = Status()
    for item in aws.scan(outputs["PipelineTableName"]):
        kind = item.get("kind")
        if kind == "upload":
            status.uploads[item["status"]] += 1
            if item["status"] == "quarantined":
                status.quarantined[item.get("reason", "unknown")] += 1
        elif kind == "sample":
            status.samples += 1
            status.packed += bool(item.get("packed_in"))
        elif kind == "shard":
            status.shards[item["status"]] += 1
        elif kind == "job":
            status.jobs.append(_job(item))
    status.jobs.sort(key=lambda j: j["created"])
    status.endpoints = _endpoints(outputs["EndpointName"])
    return status


def _job(item: dict[str, Any]) -> dict[str, Any]:
    name = item["pk"].removeprefix("JOB#")
    job = {"name": name, "status": item.get("status", ""), "shards": len(item.get("shards", [])),
           "created": item.get("at", ""), "failure": item.get("failure_reason") or None}
    try:
        described = boto3.client("sagemaker").describe_training_job(TrainingJobName=name)
        job.update(status=described["TrainingJobStatus"], secondary=described.get("SecondaryStatus"),
                   failure=described.get("FailureReason"))
    except ClientError:
        pass  # recorded, but not (or no longer) known to SageMaker
    return job


def _endpoints(name: str) -> list[dict[str, Any]]:
    try:
        described = boto3.client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError:
        return []
    return [{"name": name, "status": described["EndpointStatus"], "config": described.get("EndpointConfigName"),
             "failure": described.get("FailureReason")}]
