"""ImportFunction across a batch: redeliveries, the batch report, img2dataset's output, the CLI, lineage, takedown."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import boto3
import pytest

from atelier.local.runtime import sqs_event
from contracts.messages import LeftOut, Manifest, Sample
from core import aws
from core.import_shard import importer, records
from core.pack import seal
from contracts.messages import ImportShard
from core.import_shard.importer import import_shard
from core.partners.licensing import Revocation, revoke
from core.provenance import Affected, affected_by, lineage_of
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished, on_shard_sealed
from tests.functions.import_function_helpers import (  # noqa: F401  (small_parts, settings: fixtures)
    BATCH,
    ITEMS,
    announced,
    put_tar,
    settings,
    small_parts,
    start_batch,
)
from tests.functions.import_helpers import IMG2DATASET, run_img2dataset, sample_of, webdataset_tar
from tests.functions.pack_helpers import check_shard, sealed_record, sealed_shards


# --- idempotency ------------------------------------------------------------------------------------

def test_a_redelivered_message_imports_the_shard_once_and_counts_it_once(stack, settings, function_env,
                                                                         lambda_context) -> None:
    start_batch(stack, 1)
    message = put_tar(stack, "once.tar", webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(3)]))
    from import_shard.app import lambda_handler
    source = next(s for s in stack.sources if s.function == "ImportFunction")
    event = sqs_event([{"MessageId": "m-1", "ReceiptHandle": "r", "Body": message.model_dump_json(), "MD5OfBody": ""}],
                      source, "us-east-1")
    results = [lambda_handler(event, lambda_context) for _ in range(3)]
    assert results == [{"batchItemFailures": []}] * 3
    assert len(sealed_shards(settings.pack)) == 1 and len(announced(stack)) == 1
    report = records.batch_report(settings.ingest.table, BATCH)
    assert (report.shards_done, report.samples_accepted, len(report.shards)) == (1, 3, 1)


def test_the_handler_publishes_import_metrics(stack, settings, function_env, lambda_context, monkeypatch,
                                             capsys) -> None:
    # GIVEN metrics on (the template sets the namespace) and a tar of three new samples
    from core import telemetry
    monkeypatch.setenv("POWERTOOLS_METRICS_NAMESPACE", "Atelier")
    telemetry.metrics.clear_metrics()
    start_batch(stack, 1)
    message = put_tar(stack, "metrics.tar", webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(3)]))
    from import_shard.app import lambda_handler
    source = next(s for s in stack.sources if s.function == "ImportFunction")
    capsys.readouterr()

    # WHEN the function imports it
    lambda_handler(sqs_event([{"MessageId": "m-1", "ReceiptHandle": "r", "Body": message.model_dump_json(),
                               "MD5OfBody": ""}], source, "us-east-1"), lambda_context)

    # THEN the EMF lines count the shard by status and its samples
    blobs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    shards = [b for b in blobs if "ImportedShards" in b]
    assert [(b["status"], b["ImportedShards"]) for b in shards] == [("imported", [1.0])]
    assert [b["ImportedSamples"] for b in blobs if "ImportedSamples" in b] == [[3.0]]


def test_a_crash_after_the_commit_is_finished_by_the_redelivery(stack, settings, monkeypatch) -> None:
    start_batch(stack, 1)
    message = put_tar(stack, "crash.tar", webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(3)]))
    real = seal.finish

    def crash(shard_id: str, pack: Any) -> None:
        raise ConnectionError("the invocation died while sealing")

    monkeypatch.setattr(seal, "finish", crash)
    with pytest.raises(ConnectionError):
        import_shard(message, settings)
    monkeypatch.setattr(seal, "finish", real)
    reads: list[str] = []
    monkeypatch.setattr(importer, "read_samples", lambda *a: reads.append("read") or iter(()))
    report = import_shard(message, settings)
    assert reads == [] and report.accepted == 3  # resumed from the records, not streamed again
    [shard] = sealed_shards(settings.pack).values()
    assert len(shard.members) == 9
    assert records.batch_report(settings.ingest.table, BATCH).samples_accepted == 3


def test_the_same_tar_in_a_new_batch_brings_no_sample_twice(stack, settings) -> None:
    body = webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(3)])
    first = import_shard(put_tar(stack, "twice.tar", body), settings)
    second = import_shard(put_tar(stack, "twice.tar", body).model_copy(update={"batch_id": "batch-2"}), settings)
    assert (first.accepted, second.accepted, second.duplicates, second.status) == (3, 0, 3, "empty")


# --- the batch report ---------------------------------------------------------------------------------

def test_the_batch_report_adds_up_its_shards_by_reason(stack, settings) -> None:
    start_batch(stack, 2)
    import_shard(put_tar(stack, "a.tar", webdataset_tar([sample_of("a0", ITEMS[0]), sample_of("a1", ITEMS[0])])),
                 settings)
    import_shard(put_tar(stack, "b.tar", b"not a tar" * 100), settings)
    report = records.batch_report(settings.ingest.table, BATCH)
    assert (report.complete, report.shards_done, report.shards_rejected) == (True, 1, 1)
    assert (report.samples_read, report.samples_accepted, report.samples_duplicate) == (2, 1, 1)
    assert (report.reasons, report.shard_reasons) == ({"duplicate": 1}, {"not_a_tar": 1})


# --- img2dataset's own output --------------------------------------------------------------------------

@pytest.mark.skipif(not IMG2DATASET.exists(), reason=f"img2dataset is not installed at {IMG2DATASET} (make test builds it)")
def test_shards_downloaded_by_img2dataset_import_with_its_metadata(stack, settings, tmp_path: Path) -> None:
    # GIVEN img2dataset's output for 6 served images and one URL that 404s, 4 samples a shard
    output = run_img2dataset(ITEMS[:6], tmp_path / "out", per_shard=4, missing=1)
    tars = sorted(output.glob("*.tar"))
    assert len(tars) == 2 and all(t.with_suffix(".parquet").exists() for t in tars)
    s3 = boto3.client("s3")
    reports = []
    for tar in tars:
        for sidecar in (tar, tar.with_name(tar.stem + "_stats.json")):
            s3.upload_file(str(sidecar), stack.outputs["DataBucketName"], f"imports/{BATCH}/{sidecar.name}")
        reports.append(import_shard(ImportShard(batch_id=BATCH, bucket=stack.outputs["DataBucketName"],
                                                key=f"imports/{BATCH}/{tar.name}", partner="partner-a",
                                                license="CC-BY-4.0"), settings))
    # THEN every downloaded image is a sample, with its URL and caption; img2dataset's stats are kept
    assert sum(r.accepted for r in reports) == 6 and all(r.quarantined == {} for r in reports)
    # img2dataset's width/height, in every sample's .json, are the decoded image's
    claims = []
    for tar in tars:
        with tarfile.open(tar) as archive:
            claims += [json.loads(archive.extractfile(m).read()) for m in archive if m.name.endswith(".json")]
    assert len(claims) == 6 and all(type(c["width"]) is int and type(c["height"]) is int for c in claims)
    assert [r.size_mismatches for r in reports] == [0, 0]
    assert sum(r.source_stats["failed_to_download"] for r in reports) == 1
    by_caption = {json.loads(data)["caption"]: json.loads(data) for shard in sealed_shards(settings.pack).values()
                  for name, data in shard.members if name.endswith(".json")}
    assert sorted(by_caption) == sorted(item.sidecar["caption"] for item in ITEMS[:6])
    assert all(r["source"].startswith("http://127.0.0.1:") for r in by_caption.values())
    # img2dataset's own fields reach the shard's records unchanged: its tools read our shards as its own
    by_key = {c["key"]: c for c in claims}
    for record in by_caption.values():
        claim = by_key[record["key"]]
        assert {k: record[k] for k in ("url", "status", "original_width", "original_height")} == {
            k: claim[k] for k in ("url", "status", "original_width", "original_height")}
        assert record["upload_key"].endswith(f".tar#{record['key']}")


# --- the CLI ---------------------------------------------------------------------------------------------

def test_the_cli_queues_one_message_per_tar_resumes_and_reports(stack, settings, tmp_path, monkeypatch, capsys,
                                                                 lambda_context) -> None:
    from import_shard.app import lambda_handler

    from atelier import client
    from atelier.cli import main
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    folder = tmp_path / "laion"
    (folder / "part").mkdir(parents=True)
    (folder / "00000.tar").write_bytes(webdataset_tar([sample_of("a", ITEMS[0]), sample_of("b", ITEMS[1])]))
    (folder / "00000_stats.json").write_text(json.dumps({"count": 3, "successes": 2, "failed_to_download": 1}))
    (folder / "part" / "00001.tar").write_bytes(webdataset_tar([sample_of("c", ITEMS[2]), sample_of("d", ITEMS[1])]))
    command = ["import", str(folder), "--partner", "partner-a", "--license", "CC-BY-4.0", "--batch", "cli-1"]
    # WHEN the import is started, its messages delivered, and the same command run again with --wait
    assert main(command) == 0
    sqs, url = boto3.client("sqs"), stack.outputs["ImportQueueUrl"]
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    source = next(s for s in stack.sources if s.function == "ImportFunction")
    assert lambda_handler(sqs_event(messages, source, "us-east-1"), lambda_context) == {"batchItemFailures": []}
    capsys.readouterr()
    assert main(command + ["--wait", "--json"]) == 0
    # THEN two tars were staged and queued once each, and the report adds them up
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert len(messages) == 2 and "0 queued (2 done before)" in printed.err
    assert (report["shards_total"], report["shards_done"], report["samples_accepted"], report["samples_duplicate"]) == (
        2, 2, 3, 1)
    assert report["complete"] and sorted(s["source"].rsplit("/", 1)[1] for s in report["shards"]) == ["00000.tar", "00001.tar"]
    assert [s["source_stats"] for s in report["shards"] if s["source"].endswith("00000.tar")] == [
        {"count": 3, "successes": 2, "failed_to_download": 1}]
    assert main(["import", str(folder), "--partner", "partner-a", "--license", "other"]) == 2  # a PipelineError


def test_the_cli_imports_an_s3_prefix_in_place_through_the_function(stack, settings, monkeypatch, capsys,
                                                                    lambda_context) -> None:
    # GIVEN a partner's bucket with two tars (one with img2dataset's stats) under a prefix, one outside it
    from import_shard.app import lambda_handler

    from atelier import client
    from atelier.cli import main
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    s3, source = boto3.client("s3"), "partner-a-laion"
    s3.create_bucket(Bucket=source)
    s3.put_object(Bucket=source, Key="laion/00000.tar", Body=webdataset_tar([sample_of("a", ITEMS[0]),
                                                                             sample_of("b", ITEMS[1])]))
    s3.put_object(Bucket=source, Key="laion/00000_stats.json", Body=json.dumps({"count": 2, "successes": 2}))
    s3.put_object(Bucket=source, Key="laion/part/00001.tar", Body=webdataset_tar([sample_of("c", ITEMS[2])]))
    s3.put_object(Bucket=source, Key="elsewhere/00002.tar", Body=webdataset_tar([sample_of("d", ITEMS[3])]))
    # WHEN `atelier import s3://partner-a-laion/laion/` runs and ImportFunction gets its messages
    assert main(["import", f"s3://{source}/laion/", "--partner", "partner-a", "--license", "CC-BY-4.0",
                 "--batch", "s3-1"]) == 0
    messages = boto3.client("sqs").receive_message(QueueUrl=stack.outputs["ImportQueueUrl"],
                                                   MaxNumberOfMessages=10)["Messages"]
    event = sqs_event(messages, next(s for s in stack.sources if s.function == "ImportFunction"), "us-east-1")
    assert lambda_handler(event, lambda_context) == {"batchItemFailures": []}
    # THEN the two tars under the prefix were read in place (nothing staged) and became two sealed shards
    assert sorted(json.loads(m["Body"])["key"] for m in messages) == ["laion/00000.tar", "laion/part/00001.tar"]
    assert s3.list_objects_v2(Bucket=stack.outputs["DataBucketName"], Prefix="imports/").get("KeyCount") == 0
    report = records.batch_report(settings.ingest.table, "s3-1")
    assert (report.complete, report.shards_done, report.samples_accepted) == (True, 2, 3)
    by_source = {r.source: r for r in report.shards}
    assert sorted(by_source) == [f"s3://{source}/laion/00000.tar", f"s3://{source}/laion/part/00001.tar"]
    assert by_source[f"s3://{source}/laion/00000.tar"].source_stats == {"count": 2, "successes": 2}
    shards = sealed_shards(settings.pack)
    assert sorted(shards) == sorted(r.shard_id for r in report.shards)
    assert sorted(e["detail"]["shard_id"] for e in announced(stack)) == sorted(shards)
    # AND each sample's record says where it came from and which shard holds it
    samples = {i["pk"].removeprefix("SAMPLE#"): i for i in aws.scan_prefix(settings.ingest.table, "SAMPLE#")}
    described = {k: Sample.model_validate_json(i["record"]) for k, i in samples.items()}
    assert sorted((s.bucket, s.key, s.partner, s.license) for s in described.values()) == [
        (source, key, "partner-a", "CC-BY-4.0")
        for key in ("laion/00000.tar#a", "laion/00000.tar#b", "laion/part/00001.tar#c")]
    for shard_id, shard in shards.items():
        check_shard(settings.pack, shard_id, shard,
                    {k: s for k, s in described.items() if samples[k]["packed_in"] == shard_id})


# --- lineage and takedown of imported samples ------------------------------------------------------------

def test_an_imported_sample_is_in_its_model_s_lineage_and_a_takedown_leaves_it_out_of_the_next_manifest(
        stack, settings, function_env, monkeypatch) -> None:
    monkeypatch.setattr(aws, "create_training_job", lambda request: True)  # SageMaker itself is not needed here
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0.5")  # the next manifest replays the first one's shards
    training = TrainingSettings.current()

    def imported(*names: str) -> tuple[list[str], str | None]:
        """Each name a tar of two catalog pictures, imported and sealed, its Shard Sealed event delivered;
        the shards and the job the last event started."""
        shard_ids = []
        for name in names:
            n = 2 * int(name)
            tar = webdataset_tar([sample_of(f"{name}-{k}", ITEMS[n + k]) for k in range(2)])
            shard_ids.append(import_shard(put_tar(stack, f"{name}.tar", tar), settings).shard_id)
        decisions = [on_shard_sealed(sealed_record(settings.pack, i), training) for i in shard_ids]
        return shard_ids, decisions[-1].job_name

    def manifest(job: str) -> Manifest:
        return Manifest.model_validate_json(aws.read_object(training.data_bucket, f"manifests/{job}.json"))

    # GIVEN a model trained to completion on two imported tars
    (first, second), job = imported("0", "1")
    on_job_finished(job, "Completed", None, training)
    items = {i["pk"].removeprefix("SAMPLE#"): i for i in aws.scan_prefix(settings.ingest.table, "SAMPLE#")}
    records_ = {k: Sample.model_validate_json(i["record"]) for k, i in items.items()}
    assert len(items) == 4 and {i["packed_in"] for i in items.values()} == {first, second}
    # WHEN its lineage is read, THEN every imported sample is there with the tar it came from
    found = lineage_of(job, training)
    assert [(s.sha256, s.partner, s.license, s.bucket, s.key, s.shards, s.manifests) for s in found.samples] == [
        (k, "partner-a", "CC-BY-4.0", stack.outputs["DataBucketName"], records_[k].key, (items[k]["packed_in"],), (1,))
        for k in sorted(items)]
    taken_down = next(k for k, r in records_.items() if r.key == f"imports/{BATCH}/0.tar#0-1")
    # WHEN one imported sample is taken down
    takedown = revoke(training.table, Revocation(partner="partner-a", sha256s=(taken_down,), reason="artist request"))
    # THEN the model that learned from it is found, and the next manifest (which replays its shard) leaves it out
    assert affected_by(takedown, training) == [Affected(job=job, status="Completed", stage=0, samples=1)]
    (third, fourth), next_job = imported("2", "3")
    built = manifest(next_job)
    assert {s.shard_id: s.role for s in built.shards} == {third: "new", fourth: "new", first: "replay",
                                                           second: "replay"}
    assert built.exclude == {first: (taken_down,)}
    assert built.left_out == (LeftOut(shard_id=first, sha256=taken_down, partner="partner-a", license="CC-BY-4.0",
                                      reason=takedown.describe()),)
