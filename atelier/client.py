"""What the CLI does against a deployed pipeline, through AWS APIs only (real AWS or the local stack).

Resource names come from the CloudFormation stack's outputs, as `sam deploy` leaves them (the
local stack registers the same outputs).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import boto3
from botocore.exceptions import ClientError

from contracts import job_tags, pipeline_table, s3_layout
from core import aws
from core.ingest.uploads import PARTNER_PATTERN, SIDECAR_SUFFIX

if TYPE_CHECKING:
    from core.partners.attribution import Attribution
    from core.partners.licensing import Partner, Revocation
    from core.provenance import Affected, Lineage, Stack


# An endpoint being updated keeps serving its current model (blue/green) until the switch.
SERVING = frozenset({"InService", "Updating", "SystemUpdating", "RollingBack"})


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


def unregistered_partner(outputs: dict[str, str], partner: str, files: int) -> str | None:
    """Why an upload under `partner` would be quarantined whole (it is not registered), or None.
    Asked before the first byte goes: IngestFunction would quarantine every file as unlicensed."""
    from core.partners.licensing import get_partner
    if not PARTNER_PATTERN.fullmatch(partner):
        raise PipelineError(f"partner id {partner!r} must be lower-case letters, digits and '-' (at most 64)")
    if get_partner(outputs["PipelineTableName"], partner) is not None:
        return None
    return f"partner {partner!r} is not registered, so all {files} files would be quarantined as unlicensed"


def upload(path: Path, partner: str, bucket: str, on_bytes: Callable[[int], None] | None = None,
           s3: Any = None) -> Iterator[str]:
    """Upload a file or a folder under `<partner>/`, yielding each key as it is written (`on_bytes`: per chunk
    sent); `s3`: a client with the partner role's credentials (`atelier upload --profile`), else the caller's."""
    if not PARTNER_PATTERN.fullmatch(partner):
        raise PipelineError(f"partner id {partner!r} must be lower-case letters, digits and '-' (at most 64)")
    s3 = s3 or boto3.client("s3")
    root = path if path.is_dir() else path.parent
    for file in files_to_upload(path):
        key = f"{partner}/{file.relative_to(root).as_posix()}"
        s3.upload_file(str(file), bucket, key, Callback=on_bytes)
        yield key


# --- partners -----------------------------------------------------------------------------------

def add_partner(outputs: dict[str, str], partner_id: str, licenses: list[str], prefixes: list[str],
                terms: str, not_after: str = "", uses: list[str] | None = None,
                principals: list[str] | None = None) -> "Partner":
    """Register (or replace) a partner and the licenses it grants; `not_after` and `uses` limit
    training on every one of them (core.partners.licensing.Terms); `principals` may assume its upload role
    (atelier.partners.update_role makes it)."""
    from pydantic import ValidationError

    from core.partners.licensing import Partner, Terms, put_partner
    if not PARTNER_PATTERN.fullmatch(partner_id):
        raise PipelineError(f"partner id {partner_id!r} must be lower-case letters, digits and '-' (at most 64)")
    if not licenses:
        raise PipelineError("a partner needs at least one --license")
    try:
        rules = (Terms(not_after=not_after, uses=tuple(uses or ())),) if not_after or uses else ()
    except ValidationError as exc:
        raise PipelineError(f"--not-after {not_after!r} must be a date, YYYY-MM-DD") from exc
    return put_partner(outputs["PipelineTableName"], Partner(
        partner_id=partner_id, licenses=tuple(licenses), prefixes=tuple(prefixes or [""]), terms=terms, rules=rules,
        principals=tuple(dict.fromkeys(principals or ()))))


def partners(outputs: dict[str, str]) -> list["Partner"]:
    from core.partners.licensing import list_partners
    return list_partners(outputs["PipelineTableName"])


# --- provenance (docs/provenance.md) --------------------------------------------------------------

def places(outputs: dict[str, str]) -> "Stack":
    from core.provenance import Stack
    return Stack(table=outputs["PipelineTableName"], data_bucket=outputs["DataBucketName"],
                 models_bucket=outputs["ModelsBucketName"])


def training_job_of(outputs: dict[str, str], model: str) -> str:
    """The training job behind an endpoint, a SageMaker model (its `atelier:training-job` tag) or a job name."""
    endpoint = aws.describe_endpoint(model)
    model_name = model
    if endpoint is not None:
        config = aws.sagemaker_call("describe_endpoint_config", {"EndpointConfigName": endpoint["EndpointConfigName"]})
        model_name = config["ProductionVariants"][0]["ModelName"]
    if aws.sagemaker_exists("model", model_name):
        arn = aws.sagemaker_call("describe_model", {"ModelName": model_name})["ModelArn"]
        tags = {t["Key"]: t["Value"] for t in aws.sagemaker_call("list_tags", {"ResourceArn": arn}).get("Tags", [])}
        if job_tags.TRAINING_JOB not in tags:
            raise PipelineError(f"model {model_name} has no {job_tags.TRAINING_JOB} tag: "
                                "it was not deployed by the pipeline")
        return tags[job_tags.TRAINING_JOB]
    if aws.get_item(outputs["PipelineTableName"], pipeline_table.job_pk(model)) is None:
        raise PipelineError(f"{model!r} is no endpoint, SageMaker model or training job of this pipeline")
    return model


def lineage(outputs: dict[str, str], model: str) -> "Lineage":
    from core.provenance import stored_lineage
    return stored_lineage(training_job_of(outputs, model), places(outputs))


def attribution(outputs: dict[str, str], model: str) -> "Attribution":
    """attribution.json beside the model, or worked out now for a job that has not completed."""
    from core.partners.attribution import Attribution, read_draws
    from core.partners.attribution import attribution as report
    from core.provenance import stored_lineage
    job, where = training_job_of(outputs, model), places(outputs)
    stored = aws.read_json_if_exists(where.models_bucket, s3_layout.output_key(job, s3_layout.ATTRIBUTION_FILE))
    if stored:
        return Attribution.model_validate(stored)
    return report(stored_lineage(job, where), read_draws(where.models_bucket, job),
                  s3_layout.output_uri(where.models_bucket, job, s3_layout.LINEAGE_FILE))


def takedown(outputs: dict[str, str], partner: str, license: str, sha256s: list[str],
             reason: str) -> tuple["Revocation", list["Affected"], dict[str, list[str]]]:
    """Record a takedown; the jobs that learned from what it covers, and their SageMaker models."""
    from pydantic import ValidationError

    from core.partners.licensing import Revocation, revoke
    from core.provenance import affected_by
    try:
        revocation = Revocation(partner=partner, license=license, sha256s=tuple(sha256s), reason=reason)
    except ValidationError as exc:
        raise PipelineError(f"takedown: {exc.errors()[0]['msg']} ({exc.errors()[0]['loc']})") from exc
    recorded = revoke(outputs["PipelineTableName"], revocation)
    affected = affected_by(recorded, places(outputs))
    return recorded, affected, models_of({a.job for a in affected})


def models_of(jobs: set[str]) -> dict[str, list[str]]:
    """SageMaker models tagged with these training jobs (deploy tags each with its job)."""
    found: dict[str, list[str]] = {}
    request: dict[str, Any] = {"MaxResults": 100}
    while jobs:
        page = aws.sagemaker_call("list_models", request)
        for model in page.get("Models", []):
            tags = aws.sagemaker_call("list_tags", {"ResourceArn": model["ModelArn"]}).get("Tags", [])
            job = next((t["Value"] for t in tags if t["Key"] == job_tags.TRAINING_JOB), None)
            if job in jobs:
                found.setdefault(job, []).append(model["ModelName"])
        if not page.get("NextToken"):
            break
        request["NextToken"] = page["NextToken"]
    return found


# --- generate -----------------------------------------------------------------------------------

def generate(endpoint: str, prompt: str, seed: int, steps: int, guidance: float | None = None) -> bytes:
    """A PNG from the endpoint; `guidance` None leaves the server's default (trainer/serve/protocol.py)."""
    request = {"prompt": prompt, "seed": seed, "num_inference_steps": steps}
    if guidance is not None:
        request["guidance_scale"] = guidance
    body = json.dumps(request)
    try:
        response = boto3.client("sagemaker-runtime").invoke_endpoint(
            EndpointName=endpoint, ContentType="application/json", Accept="image/png", Body=body)
    except ClientError as exc:
        # SageMaker answers "not found" for an endpoint that exists but is not InService yet
        reason = not_serving(endpoint) or exc.response["Error"].get("Message", str(exc))
        raise PipelineError(f"endpoint {endpoint!r}: {reason}") from exc
    return response["Body"].read()


def not_serving(endpoint: str, now: datetime | None = None) -> str | None:
    """Why an endpoint takes no invocations now, in a sentence; None when it should take them."""
    from atelier.failures import elapsed
    described = aws.describe_endpoint(endpoint)
    if described is None:
        return "no such endpoint: nothing was deployed under that name yet (`atelier status` shows the pipeline's stages)"
    status = described["EndpointStatus"]
    if status in SERVING:
        return None
    since = described["CreationTime"] if status == "Creating" else described["LastModifiedTime"]
    age = elapsed(((now or datetime.now(timezone.utc)) - since).total_seconds())
    failure = f" ({described['FailureReason']})" if described.get("FailureReason") else ""
    return (f"it is {status}{failure}, for {age} now (since {since.astimezone(timezone.utc):%H:%M:%S} UTC); it takes "
            "invocations once InService: `atelier status --watch` follows it")


# --- status -------------------------------------------------------------------------------------

@dataclass
class Status:
    uploads: Counter[str] = field(default_factory=Counter)  # objects partners put in the uploads bucket
    quarantined: Counter[str] = field(default_factory=Counter)
    imported: int = 0  # samples `atelier import` brought from shards made elsewhere
    imports_quarantined: Counter[str] = field(default_factory=Counter)
    samples: int = 0
    packed: int = 0
    shards: Counter[str] = field(default_factory=Counter)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    endpoints: list[dict[str, Any]] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    lineages: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"uploads": dict(self.uploads), "quarantined": dict(self.quarantined),
                "imports": {"samples": self.imported, "quarantined": dict(self.imports_quarantined)},
                "samples": self.samples, "packed": self.packed, "shards": dict(self.shards), "jobs": self.jobs, "endpoints": self.endpoints,
                "models": self.models, "lineages": self.lineages}


def scan_kinds(table: str, kinds: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """The table's items of these kinds. The filter runs in DynamoDB: the near-duplicate index's
    many items (16 per sample, without a kind) never cross the wire."""
    values = {f":k{n}": {"S": kind} for n, kind in enumerate(kinds)}
    return aws.scan(table, FilterExpression=f"#kind IN ({', '.join(values)})", ExpressionAttributeNames={"#kind": "kind"},
                    ExpressionAttributeValues=values)


STATUS_KINDS = ("upload", "sample", "shard", "job", "model", "lineage")


def pipeline_status(outputs: dict[str, str]) -> Status:
    status = Status()
    for item in scan_kinds(outputs["PipelineTableName"], STATUS_KINDS):
        kind = item.get("kind")
        if kind == "upload" and item.get("import_batch"):  # a sample of an imported tar it refused
            if item["status"] == "quarantined":
                status.imports_quarantined[item.get("reason", "unknown")] += 1
        elif kind == "upload":
            status.uploads[item["status"]] += 1
            if item["status"] == "quarantined":
                status.quarantined[item.get("reason", "unknown")] += 1
        elif kind == "sample":
            status.samples += 1
            status.packed += bool(item.get("packed_in"))
            status.imported += sample_origin(json.loads(item.get("record") or "{}"), outputs["UploadsBucketName"]) == "import"
        elif kind == "shard":
            status.shards[item["status"]] += 1
        elif kind == "job":
            status.jobs.append(_job(item))
        elif kind == "model":
            status.models.append(model_summary(item))
        elif kind == "lineage":
            status.lineages.append(lineage_summary(item))
    status.jobs.sort(key=lambda j: j["created"])
    status.models.sort(key=lambda m: m["order"])
    status.endpoints = _endpoints(outputs["EndpointName"])
    return status


def sample_origin(record: dict[str, Any], uploads_bucket: str) -> str:
    """"upload" for a sample (its parsed record) a partner put in the uploads bucket, "import" for one
    `atelier import` brought (its record names the source tar in the data bucket)."""
    return "upload" if record.get("bucket", uploads_bucket) == uploads_bucket else "import"


def _job(item: dict[str, Any]) -> dict[str, Any]:
    name = pipeline_table.job_name(item["pk"])
    job = {"name": name, "role": item.get("role", "train"), "status": item.get("status", ""), "shards": len(item.get("shards", [])),
           "created": item.get("at", ""), "failure": item.get("failure_reason") or None}
    try:
        described = boto3.client("sagemaker").describe_training_job(TrainingJobName=name)
        job.update(status=described["TrainingJobStatus"], secondary=described.get("SecondaryStatus"),
                   failure=described.get("FailureReason"))
    except ClientError:
        pass  # recorded, but not (or no longer) known to SageMaker
    return job


def model_summary(item: dict[str, Any]) -> dict[str, Any]:
    """A deploy candidate as people read it: the gate's decision, its scores and the reason."""
    gate = json.loads(item.get("gate") or "{}")
    scores = gate.get("scores") or {}
    production = gate.get("production") or {}
    return {"model": item["model"], "status": item.get("status", ""), "job": item.get("job", ""),
            "manifest": item.get("manifest", ""), "order": int(item.get("order", 0)),
            "decision": gate.get("decision"), "reason": item.get("reason", ""),
            "val_loss": _number(scores.get("val_loss")), "clip_score": _number(scores.get("clip_score")),
            "production_model": gate.get("production_model") or None,
            "production_val_loss": _number(production.get("val_loss")),
            "production_clip_score": _number(production.get("clip_score")),
            "eval_job": item.get("eval_job"), "deployed_at": item.get("deployed_at")}


def _number(value: Any) -> float | None:
    return None if value in (None, "") else float(value)


def models(outputs: dict[str, str]) -> list[dict[str, Any]]:
    found = [model_summary(i) for i in aws.scan_prefix(outputs["PipelineTableName"], pipeline_table.MODEL_PREFIX)]
    return sorted(found, key=lambda m: m["order"])


def lineage_summary(item: dict[str, Any]) -> dict[str, Any]:
    """A lineage's brake for `atelier status`."""
    from core.start_training import failure_brake
    brake = failure_brake.Brake.from_item(item)
    return {"name": pipeline_table.lineage_name(item["pk"]), "running_job": item.get("running_job") or None,
            "held": failure_brake.hold(brake, time.time()), "model_failures": brake.model_failures,
            "failures": list(brake.failures[-3:])}


def _endpoints(name: str) -> list[dict[str, Any]]:
    try:
        described = boto3.client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError:
        return []
    return [{"name": name, "status": described["EndpointStatus"], "config": described.get("EndpointConfigName"),
             "failure": described.get("FailureReason")}]
