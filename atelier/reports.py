"""Reports for people: what became of one partner's uploads, and a training job's HTML report.

Both read what the pipeline already records (the table, manifests, each model's lineage, the job's
S3 output) through AWS APIs.
"""

from __future__ import annotations

import json
import tarfile
from collections import Counter, defaultdict
from contextlib import suppress
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import trainer.report.render as report_html
from atelier import client
from atelier.client import PipelineError
from contracts import pipeline_table, s3_layout
from contracts.messages import Manifest
from core import aws, provenance

AFTER_TRAINING = (s3_layout.EVALUATION_FILE, s3_layout.LINEAGE_FILE)  # written beside the artefact by deploy / start-training


def partner_report(outputs: dict[str, str], partner: str) -> dict[str, Any]:
    """Every upload of `partner`: accepted or rejected (why), the shard it is in, the jobs that trained
    on it and the models that hold it."""
    uploads, samples, imported, shards, jobs, models = [], {}, [], {}, [], []
    for item in client.scan_kinds(outputs["PipelineTableName"], ("upload", "sample", "shard", "job", "model")):
        kind = item.get("kind")
        if kind == "upload" and item.get("partner") == partner:
            uploads.append(item)
        elif kind == "sample" and item.get("partner") == partner:
            samples[pipeline_table.sample_sha256(item["pk"])] = item.get("packed_in")
            record = json.loads(item.get("record") or "{}")
            if client.sample_origin(record, outputs["UploadsBucketName"]) == "import":  # no upload record: the sample is it
                imported.append({"pk": pipeline_table.upload_pk(record["bucket"], record["key"]), "status": "accepted",
                                 "sha256": record["sha256"], "at": record.get("uploaded_at"), "import_batch": True})
        elif kind == "shard":
            shards[pipeline_table.shard_id_of(item["pk"])] = item
        elif kind == "job" and item.get("role") not in provenance.HELPER_ROLES:  # its training job's samples
            jobs.append(item)
        elif kind == "model":
            models.append(item)
    jobs.sort(key=lambda j: (j.get("at", ""), int(j.get("sequence", 0)), int(j.get("stage", 0)), _name(j)))
    models.sort(key=lambda m: (int(m.get("order", 0)), m["model"]))
    jobs_of_shard: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        for shard_id in [*job.get("shards", []), *job.get("replay", [])]:
            jobs_of_shard[shard_id].append(job)
    left_out = _left_out(outputs["DataBucketName"])
    uploads += imported
    mine = {u["sha256"]: samples.get(u["sha256"]) for u in uploads if u["status"] == "accepted" and u.get("sha256")}
    holding = _models_holding(outputs, {sha: shard for sha, shard in mine.items() if shard}, models)
    items = []
    for upload in sorted(uploads, key=lambda u: u["pk"]):
        sha = upload.get("sha256") or ""
        shard = mine.get(sha) if upload["status"] == "accepted" else None
        trained = [_name(j) for j in jobs_of_shard.get(shard or "", []) if sha not in left_out(j, shard or "")]
        origin = "import" if upload.get("import_batch") else "upload"
        items.append({"key": pipeline_table.upload_key(upload["pk"]), "origin": origin,
                      "status": upload["status"], "reason": upload.get("reason"), "detail": upload.get("detail"),
                      "sha256": upload.get("sha256"), "uploaded_at": upload.get("at"), "shard": shard, "jobs": trained,
                      "models": holding.get(sha, []) if shard else []})
    used_shards = sorted({i["shard"] for i in items if i["shard"]})
    held = [m for m in models if any(m["model"] in i["models"] for i in items)]
    model_of_job = {m.get("job"): m["model"] for m in models}
    named = {name for i in items for name in i["jobs"]} | {m.get("job") for m in held}  # and the jobs behind the models
    return {
        "partner": partner,
        "uploads": sum(i["origin"] == "upload" for i in items),
        "imported": sum(i["origin"] == "import" for i in items),  # samples of imported tars, accepted or refused
        "accepted": sum(i["status"] == "accepted" for i in items),
        "rejected": dict(Counter(i["reason"] or "unknown" for i in items if i["status"] == "quarantined")),
        "packed": sum(bool(i["shard"]) for i in items),
        "by_origin": {origin: {"items": sum(i["origin"] == origin for i in items),
                               "accepted": sum(i["origin"] == origin and i["status"] == "accepted" for i in items),
                               "packed": sum(i["origin"] == origin and bool(i["shard"]) for i in items)}
                      for origin in ("upload", "import")},
        "shards": [{"shard": s, "status": shards.get(s, {}).get("status", "packing"),
                    "samples": sum(i["shard"] == s for i in items), "jobs": [_name(j) for j in jobs_of_shard.get(s, [])]}
                   for s in used_shards],
        "jobs": [{"job": _name(j), "status": j.get("status"), "model": model_of_job.get(_name(j))}
                 for j in jobs if _name(j) in named],
        "models": [{"model": m["model"], "job": m.get("job"), "status": m.get("status"),
                    "samples": sum(m["model"] in i["models"] for i in items)} for m in held],
        "items": items,
    }


def _name(job: dict[str, Any]) -> str:
    return pipeline_table.job_name(job["pk"])


def _left_out(data_bucket: str) -> Callable[[dict[str, Any], str], set[str]]:
    """The samples of a shard that a job's manifest left out (read once per manifest)."""
    manifests: dict[str, Manifest] = {}

    def left_out(job: dict[str, Any], shard_id: str) -> set[str]:
        if job["manifest"] not in manifests:
            manifests[job["manifest"]] = Manifest.model_validate_json(aws.read_object(data_bucket, job["manifest"]))
        return set(manifests[job["manifest"]].exclude.get(shard_id, ()))
    return left_out


def _models_holding(outputs: dict[str, str], samples: dict[str, str], models: list[dict[str, Any]]) -> dict[str, list[str]]:
    """sample sha256 -> the models (deploy candidates, oldest first) whose lineage holds it: its own
    manifest through every stage, and every earlier manifest of its lineage the model resumed from
    (core.provenance), less what those manifests left out. `samples` maps each sample to its shard."""
    holding: dict[str, list[str]] = defaultdict(list)
    if not samples:
        return holding
    places = client.places(outputs)
    for model in models:
        try:
            lineage = provenance.stored_lineage(model.get("job") or model["model"], places)
        except provenance.UnknownModel:  # a candidate of a job this pipeline did not start
            continue
        listed = {source.sha256 for source in lineage.samples}
        # a shard without an index has its samples unlisted; a manifest leaves such a shard whole or out
        unindexed = {s.shard_id for m in lineage.manifests for s in m.shards if not s.index_uri}
        for sha, shard in samples.items():
            if sha in listed or shard in unindexed:
                holding[sha].append(model["model"])
    return holding


def job_report(outputs: dict[str, str], job: str) -> bytes:
    """The job's complete report.html, rendered here with the trainer's renderer (trainer/report/render.py):
    the run's figures and grids from its output data (an older trainer's record in model.tar.gz), with
    the gate's `evaluation.json` and `lineage.json` beside the artefact; with neither figures nor a
    decision, the page the trainer wrote."""
    bucket, folder = outputs["ModelsBucketName"], s3_layout.output_folder(job)
    run, grids = report_data(bucket, folder)
    if run is None and aws.head_object(bucket, f"{folder}/{s3_layout.MODEL_ARCHIVE}") is not None:
        with suppress(FileNotFoundError):  # an older trainer's page carries no figures: its record, streamed up to it
            record = aws.read_tar_member(f"s3://{bucket}/{folder}/{s3_layout.MODEL_ARCHIVE}", s3_layout.TRAINING_RECORD)
            run = report_html.run_data(json.loads(record))
    evaluation, lineage = (aws.read_json_if_exists(bucket, f"{folder}/{name}") for name in AFTER_TRAINING)
    if run is not None or evaluation is not None:  # a candidate's page says what the gate decided, figures or not
        return report_html.page(job, run, grids, evaluation, lineage).encode()
    if aws.head_object(bucket, f"{folder}/output.tar.gz") is not None:
        _, body = aws.open_object(bucket, f"{folder}/output.tar.gz")
        with body:
            page = report_from_tar(body)
        if page is not None:
            return page
    raise PipelineError(f"no {s3_layout.REPORT_FILE} for job {job!r} under s3://{bucket}/{folder}/: "
                        "has it finished? (`atelier status` lists jobs)")


def report_data(bucket: str, folder: str) -> tuple[dict[str, Any] | None, list[tuple[str, bytes]]]:
    """The run's figures and validation grids a training job left in `folder`, from its output.tar.gz
    (the trainer's report.html carries the figures; a page from an older trainer has none: None)."""
    if aws.head_object(bucket, f"{folder}/output.tar.gz") is None:
        return None, []
    _, body = aws.open_object(bucket, f"{folder}/output.tar.gz")
    with body:
        return report_html.read_output(body)


def fetch_tensorboard(outputs: dict[str, str], job: str, folder: Path) -> tuple[str, int]:
    """The job's TensorBoard event files (TensorBoardOutputConfig) into `folder`: their S3 prefix and count."""
    from core.start_training.job_requests import tensorboard_uri
    bucket = outputs["ModelsBucketName"]
    uri = tensorboard_uri(bucket, job)
    prefix = uri.removeprefix(f"s3://{bucket}/")
    count = 0
    for item in aws.list_objects(bucket, prefix):
        relative = PurePosixPath(item["Key"].removeprefix(prefix))
        if ".." in relative.parts or relative.is_absolute():
            continue  # a key that would land outside the folder
        target = folder.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(aws.read_object(bucket, item["Key"]))
        count += 1
    if not count:
        raise PipelineError(f"no TensorBoard files for job {job!r} under {uri}: a training job writes them from its "
                            "first logged step (`atelier status` lists jobs)")
    return uri, count


def report_from_tar(stream: Any) -> bytes | None:
    """The first report.html in a gzipped tar read front to back (nothing is written to disk)."""
    with tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            if member.isfile() and PurePosixPath(member.name).name == s3_layout.REPORT_FILE:
                extracted = tar.extractfile(member)
                return extracted.read() if extracted else None
    return None
