"""Every file in events/ goes through its handler under moto, with resources from template.yaml."""

from __future__ import annotations

import importlib
import io
import json
import re
import tarfile
from typing import Any, Callable

import boto3
import pytest

from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from contracts import job_tags
from tests.support import EVENTS, load_event, sagemaker_job

HANDLERS = {"ingest": "IngestFunction", "pack": "PackFunction", "start_training": "StartTrainingFunction",
            "deploy": "DeployFunction", "import": "ImportFunction"}


def event_names() -> list[str]:
    return sorted(p.stem for p in EVENTS.glob("*.json") if p.stem != "env")


def function_for(event_name: str) -> str:
    prefix = next(p for p in sorted(HANDLERS, key=len, reverse=True) if event_name.startswith(p + "_"))
    return HANDLERS[prefix]


def run_handler(stack: Provisioned, function_env: Callable, logical_id: str, event: dict, context: Any) -> Any:
    function_env(logical_id)
    module = importlib.import_module(stack.functions[logical_id].handler.rsplit(".", 1)[0])
    return module.lambda_handler(event, context)


def upload_keys(event: dict) -> list[str]:
    """The decoded object keys an S3 notification event names."""
    from core.ingest.uploads import parse_notification
    keys = []
    for record in event["Records"]:
        try:
            keys += [ref.key for ref in parse_notification(record["body"])]
        except ValueError:
            pass
    return keys


# --- the arrangement each event needs ------------------------------------------------------------

def arrange(name: str, event: dict, stack: Provisioned) -> None:
    s3 = boto3.client("s3")
    uploads = stack.outputs["UploadsBucketName"]
    if name.startswith("ingest_"):
        versions = {}
        for key in upload_keys(event):
            body = b"<html>not an image</html>" if "not-really" in key else encode(picture("circle", "red", "blue"), "png")
            versions[key] = s3.put_object(Bucket=uploads, Key=key, Body=body)["VersionId"]
        name_versions(event, versions)
    elif name.startswith("pack_"):
        for record in event.get("Records", []):  # the seal timer's event has none
            sample = json.loads(record["body"])
            s3.put_object(Bucket=sample["bucket"], Key=sample["key"], Body=b"image bytes of " + sample["key"].encode())
    elif name == "start_training_encode_completed":
        arrange_encoded(event, stack)
    elif name == "start_training_autoencoder_completed":
        arrange_autoencoded(event, stack)
    elif name.startswith("deploy_"):
        arrange_deploy(name, event, stack)
    elif name.startswith("import_"):
        arrange_import(event, stack)


def name_versions(event: dict, versions: dict[str, str]) -> None:
    """The event's notifications name the versions just put, as AWS's would (ingest reads the version
    a notification names; the file's versionId, from AWS's sample event, exists in no bucket)."""
    from urllib.parse import unquote_plus
    for record in event["Records"]:
        try:
            body = json.loads(record["body"])
        except json.JSONDecodeError:
            continue  # the malformed message stays as it is
        for notification in body.get("Records", []):
            s3_object = notification["s3"]["object"]
            if unquote_plus(s3_object["key"]) in versions:
                s3_object["versionId"] = versions[unquote_plus(s3_object["key"])]
        record["body"] = json.dumps(body)


def arrange_import(event: dict, stack: Provisioned) -> None:
    """The staged tar each message names (two samples, one caption missing) and its batch record."""
    from core import aws
    from contracts.messages import ImportShard
    from core.import_shard import records
    from tests.functions.import_helpers import webdataset_tar
    pictures = [encode(picture("circle", "red", "blue"), "png"), encode(picture("square", "white", "black"), "jpg")]
    for record in event["Records"]:
        message = ImportShard.model_validate_json(record["body"])
        body = webdataset_tar([{"__key__": b"000000", "png": pictures[0], "txt": b"a red circle on a blue background"},
                               {"__key__": b"000001", "jpg": pictures[1]}])
        boto3.client("s3").put_object(Bucket=message.bucket, Key=message.key, Body=body)
        aws.put_item(stack.outputs["PipelineTableName"], records.batch_item(
            message.batch_id, message.partner, message.license, "events/import_shard.json", 1))


def arrange_encoded(event: dict, stack: Provisioned) -> None:
    """The training job the encode job worked for (claimed, holding the lineage), its manifest of
    one shard, and the latent shard the encode job uploaded."""
    from contracts import pipeline_table
    from contracts.messages import Manifest, ShardRef
    from core import aws
    table, data, models = (stack.outputs[k] for k in ("PipelineTableName", "DataBucketName", "ModelsBucketName"))
    encode_job = event["detail"]["TrainingJobName"]
    job = encode_job.removesuffix("-enc")
    manifest = Manifest(bucket=data, prefix="shards/", lineage="main", sequence=1, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="a" * 64, samples=1, partners=("p",)),))
    aws.write_object(data, f"manifests/{job}.json", manifest.model_dump_json().encode())
    aws.put_item(table, {"pk": pipeline_table.job_pk(job), "kind": "job", "status": "Requested", "manifest": f"manifests/{job}.json",
                         "base": job, "stage": 0, "digest": manifest.digest, "lineage": "main", "encode": True,
                         "shards": ["shard-1"], "steps_base": 0})
    aws.put_item(table, {"pk": pipeline_table.job_pk(encode_job), "kind": "job", "role": "encode", "for_job": job,
                         "status": "Requested", "lineage": "main"})
    aws.put_item(table, {"pk": "LINEAGE#main", "kind": "lineage", "sequence": 1, "steps_done": 0, "queue": [],
                         "running_job": job})
    boto3.client("s3").put_object(Bucket=models, Key=f"encoded/{job}/latents/0123456789abcdef-r256/shard-1.tar",
                                  Body=b"latent shard")


def arrange_autoencoded(event: dict, stack: Provisioned) -> None:
    """The training job the lineage's autoencoder job ran for (claimed, holding the lineage, waiting for
    the VAE), its manifest of one shard, and the autoencoder job as SageMaker describes it."""
    from contracts import pipeline_table
    from contracts.messages import Manifest, ShardRef
    from core import aws
    from core.start_training.manifests import manifest_file
    table, data, models = (stack.outputs[k] for k in ("PipelineTableName", "DataBucketName", "ModelsBucketName"))
    autoencoder_job = event["detail"]["TrainingJobName"]
    job = autoencoder_job.removesuffix("-ae")
    manifest = Manifest(bucket=data, prefix="shards/", lineage="main", sequence=1, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="a" * 64, samples=1, partners=("p",)),))
    aws.write_object(data, f"manifests/{job}.json", manifest.model_dump_json().encode())
    aws.write_object(data, f"manifests/{job}.manifest", json.dumps(manifest_file(manifest)).encode())
    aws.put_item(table, {"pk": pipeline_table.job_pk(job), "kind": "job", "status": "Requested", "manifest": f"manifests/{job}.json",
                         "base": job, "stage": 0, "digest": manifest.digest, "lineage": "main", "encode": False,
                         "autoencoder": True, "pretrained": "", "shards": ["shard-1"], "steps_base": 0})
    aws.put_item(table, {"pk": pipeline_table.job_pk(autoencoder_job), "kind": "job", "role": "autoencoder", "for_job": job,
                         "status": "Requested", "lineage": "main"})
    aws.put_item(table, {"pk": "LINEAGE#main", "kind": "lineage", "sequence": 1, "steps_done": 0, "queue": [],
                         "running_job": job, "autoencoder": True})
    sagemaker_job(autoencoder_job, f"s3://{models}/autoencoder/", {})  # its artefact where the event says


def arrange_deploy(name: str, event: dict, stack: Provisioned) -> None:
    """The model artefact, and its training job as SageMaker knows it, with the pipeline's tags (the
    events carry none); for the evaluation's end, the candidate it scored and its evaluation.json; for
    an encode job's end, that job."""
    s3, models = boto3.client("s3"), stack.outputs["ModelsBucketName"]
    s3.put_object(Bucket=stack.outputs["DataBucketName"], Key="eval/heldout.tar", Body=bytes(1024))  # EvalDataPrefix
    job = load_event("deploy_job_completed")["detail"]
    s3.put_object(Bucket=models, Key=job["ModelArtifacts"]["S3ModelArtifacts"].split("/", 3)[3], Body=b"model")
    stage_tags = {job_tags.MANIFEST: "ab" * 32, job_tags.LINEAGE: "main", job_tags.PLANNED_JOB: "main"}
    sagemaker_job(job["TrainingJobName"], f"s3://{models}/training/", {**stage_tags, job_tags.FINAL_PLANNED_JOB: "true"})
    if name == "deploy_encode_job_completed":
        sagemaker_job(event["detail"]["TrainingJobName"], f"s3://{models}/encoded/", {
            **stage_tags, job_tags.FINAL_PLANNED_JOB: "false", job_tags.ROLE: job_tags.ENCODE,
            job_tags.TRAINING_JOB: job["TrainingJobName"]})
    if name == "deploy_evaluate_request":  # a candidate whose evaluation failed
        from contracts import pipeline_table
        from core import aws
        from core.deploy.candidates import on_job_state
        from core.deploy.events import job_state_from_event
        from core.deploy.settings import DeploySettings
        settings = DeploySettings.current(stack.functions["DeployFunction"].environment)
        on_job_state(job_state_from_event(job), settings)
        aws.update_item(settings.table, pipeline_table.model_pk(job["TrainingJobName"]), "SET #s = :f",
                        {":f": "eval-failed"}, names={"#s": "status"})
    if name == "deploy_evaluation_completed":
        from core.deploy.candidates import on_job_state
        from core.deploy.events import job_state_from_event
        from core.deploy.settings import DeploySettings
        on_job_state(job_state_from_event(job), DeploySettings.current(stack.functions["DeployFunction"].environment))
        document = json.dumps({"schema": 1, "eval_set": {"digest": "e" * 64, "samples": 4},
                               "models": {"candidate": {"val_loss": 0.1, "clip_score": None}}}).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            info = tarfile.TarInfo("evaluation.json")
            info.size = len(document)
            archive.addfile(info, io.BytesIO(document))
        s3.put_object(Bucket=models, Key=event["detail"]["ModelArtifacts"]["S3ModelArtifacts"].split("/", 3)[3],
                      Body=buffer.getvalue())


class Matching(str):
    """Equal to any string its pattern matches whole: a reason that names a resource of the stack."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and re.fullmatch(str(self), other) is not None

    __hash__ = str.__hash__


@pytest.mark.parametrize("name", event_names())
def test_every_event_is_handled(name: str, stack: Provisioned, partner: str, function_env: Callable,
                                lambda_context: Any) -> None:
    # GIVEN the objects and records the event refers to
    event = load_event(name)
    arrange(name, event, stack)
    # WHEN its handler runs
    result = run_handler(stack, function_env, function_for(name), event, lambda_context)
    # THEN it succeeds, failing exactly the records that cannot succeed
    assert result == EXPECTED[name](event)


EXPECTED: dict[str, Callable[[dict], Any]] = {
    "ingest_s3_put": lambda e: {"batchItemFailures": []},
    "ingest_s3_test_event": lambda e: {"batchItemFailures": []},
    # the malformed message alone goes back to the queue (and on to the DLQ)
    "ingest_mixed_batch": lambda e: {"batchItemFailures": [{"itemIdentifier": e["Records"][2]["messageId"]}]},
    "pack_samples": lambda e: {"batchItemFailures": []},
    "pack_seal_timer": lambda e: {"sealed": []},  # nothing open yet
    "start_training_shard_sealed": lambda e: {"action": "waiting", "job": None},  # quota is 2
    # the schedule that ends a failure backoff: nothing pending, nothing to start
    "start_training_retry_schedule": lambda e: {"action": "waiting", "job": None},
    # `atelier lineage resume main`: the brake is off, nothing is pending yet
    "start_training_lineage_resumed": lambda e: {"action": "waiting", "job": None},
    # moto's EventBridge delivers events without `account`
    "start_training_moto_shard_sealed": lambda e: {"action": "waiting", "job": None},
    # latent shards ready: the training job they were encoded for starts on them
    "start_training_encode_completed": lambda e: {"action": "encoded",
                                                  "job": e["detail"]["TrainingJobName"].removesuffix("-enc")},
    # the lineage's VAE trained: the training job that waited for it starts, reading it as `vae`
    "start_training_autoencoder_completed": lambda e: {"action": "autoencoded",
                                                       "job": e["detail"]["TrainingJobName"].removesuffix("-ae")},
    # an encode job's end, its tags read from SageMaker: never a candidate
    "deploy_encode_job_completed": lambda e: {"action": "recorded", "model": None,
                                              "reason": "Completed, final run-plan job False"},
    # a candidate (its tags read from SageMaker): its evaluation job starts
    "deploy_job_completed": lambda e: {"action": "evaluating", "model": e["detail"]["TrainingJobName"], "reason": ""},
    # an eval-failed model evaluated again on an operator's request (`atelier evaluate`)
    "deploy_evaluate_request": lambda e: {"action": "evaluating", "model": e["detail"]["model"], "reason": ""},
    # `atelier rollback` where nothing was deployed yet: refused, an answer rather than an error to retry
    "deploy_rollback_request": lambda e: {"action": "refused", "model": None,
                                          "reason": Matching(r"endpoint \S+ has no deployed model to roll back")},
    "deploy_job_failed": lambda e: {"action": "recorded", "model": None, "reason": "Failed, final run-plan job True"},
    # the evaluation passed the gate: the first model creates the endpoint
    "deploy_evaluation_completed": lambda e: {"action": "created", "model": e["detail"]["Tags"]["atelier:candidate"],
                                              "reason": ""},
    # the artefact of a Completed job: the same candidate as its Completed event
    "deploy_model_artefact_created": lambda e: {"action": "evaluating", "model": e["detail"]["object"]["key"].split("/")[1],
                                                "reason": ""},
    "deploy_endpoint_in_service": lambda e: {"action": "recorded", "model": None, "reason": "endpoint gone"},
    "import_shard": lambda e: {"batchItemFailures": []},
}


def test_every_event_file_has_an_expectation() -> None:
    assert sorted(EXPECTED) == event_names()


# --- what each handler did -------------------------------------------------------------------------

def table_items(stack: Provisioned, prefix: str) -> dict[str, dict]:
    from core import aws
    return {i["pk"]: i for i in aws.scan_prefix(stack.outputs["PipelineTableName"], prefix)}


def test_ingest_decodes_plus_and_space_keys_and_hands_over(stack, partner, function_env, lambda_context) -> None:
    event = load_event("ingest_s3_put")
    arrange("ingest_s3_put", event, stack)
    run_handler(stack, function_env, "IngestFunction", event, lambda_context)
    uploads = table_items(stack, "UPLOAD#")
    bucket = stack.outputs["UploadsBucketName"]
    record = uploads[f"UPLOAD#{bucket}/partner-a/summer catalog/red circle + blue.png"]
    assert record["status"] == "accepted" and record["partner"] == "partner-a"
    messages = boto3.client("sqs").receive_message(QueueUrl=stack.outputs["PackQueueUrl"], MaxNumberOfMessages=10)
    bodies = [json.loads(m["Body"]) for m in messages["Messages"]]
    assert [(b["key"], b["format"], b["width"], b["height"]) for b in bodies] == [
        ("partner-a/summer catalog/red circle + blue.png", "png", 96, 96)]


def test_ingest_quarantines_what_does_not_decode_and_records_why(stack, partner, function_env, lambda_context) -> None:
    event = load_event("ingest_mixed_batch")
    arrange("ingest_mixed_batch", event, stack)
    run_handler(stack, function_env, "IngestFunction", event, lambda_context)
    uploads = table_items(stack, "UPLOAD#")
    bucket = stack.outputs["UploadsBucketName"]
    assert uploads[f"UPLOAD#{bucket}/partner-a/photos/not-really.jpg"]["status"] == "quarantined"
    assert uploads[f"UPLOAD#{bucket}/partner-a/photos/not-really.jpg"]["reason"] == "not_an_image"
    assert uploads[f"UPLOAD#{bucket}/partner-a/photos/sunset.jpg"]["status"] == "accepted"


def test_ingest_reads_caption_and_license_from_the_sidecar(stack, partner, function_env, lambda_context) -> None:
    event = load_event("ingest_s3_put")
    bucket = stack.outputs["UploadsBucketName"]
    boto3.client("s3").put_object(Bucket=bucket, Key="partner-a/summer catalog/red circle + blue.json",
                                  Body=json.dumps({"caption": "a red circle", "license": "CC-BY-4.0"}))
    arrange("ingest_s3_put", event, stack)
    run_handler(stack, function_env, "IngestFunction", event, lambda_context)
    sample = json.loads(next(iter(table_items(stack, "SAMPLE#").values()))["record"])
    assert (sample["caption"], sample["license"]) == ("a red circle", "CC-BY-4.0")


def test_pack_writes_a_webdataset_shard_and_announces_it(stack, function_env, lambda_context, monkeypatch) -> None:
    import webdataset as wds
    event = load_event("pack_samples")
    arrange("pack_samples", event, stack)
    function_env("PackFunction")
    monkeypatch.setenv("SHARD_MAX_SAMPLES", "2")  # the event's two samples fill a shard
    run_handler(stack, lambda logical_id: None, "PackFunction", event, lambda_context)
    data = stack.outputs["DataBucketName"]
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=data, Prefix="shards/")["Contents"]]
    assert len(keys) == 1 and keys[0].startswith("shards/shard-") and keys[0].endswith(".tar")
    body = boto3.client("s3").get_object(Bucket=data, Key=keys[0])["Body"].read()
    samples = [json.loads(r["body"]) for r in event["Records"]]
    # THEN webdataset reads back exactly the two samples, bytes and captions included
    read = {s["__key__"]: s for s in wds.WebDataset([_as_file(body)], shardshuffle=False)}
    assert sorted(read) == sorted(s["sha256"] for s in samples)
    for sample in samples:
        member = read[sample["sha256"]]
        ext = {"png": "png", "jpeg": "jpg"}[sample["format"]]
        assert member[ext] == b"image bytes of " + sample["key"].encode()
        assert member["txt"].decode() == sample["caption"]
        assert json.loads(member["json"])["license"] == sample["license"]
    shard_id = keys[0].removeprefix("shards/").removesuffix(".tar")
    assert {pk: i["packed_in"] for pk, i in table_items(stack, "SAMPLE#").items()} == {
        f"SAMPLE#{s['sha256']}": shard_id for s in samples}
    # AND the "Shard Sealed" event reached the start-training function's delivery queue
    source = next(s for s in stack.sources if s.function == "StartTrainingFunction" and "ShardSealed" in s.rule_arn)
    delivered = boto3.client("sqs").receive_message(QueueUrl=source.queue_url)["Messages"]
    detail = json.loads(delivered[0]["Body"])["detail"]
    assert (detail["shard_id"], detail["samples"], detail["partners"]) == (shard_id, 2, ["partner-a", "partner-b"])


def _as_file(body: bytes) -> str:
    import tempfile
    handle = tempfile.NamedTemporaryFile(suffix=".tar", delete=False)
    handle.write(body)
    handle.close()
    return handle.name
