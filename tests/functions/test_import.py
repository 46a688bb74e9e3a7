"""ImportFunction under moto: existing WebDataset tars validated, deduplicated, rewritten as sealed shards."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest
from PIL import Image

from atelier.catalog import make_catalog
from atelier.local.provision import Provisioned
from atelier.local.runtime import sqs_event
from contracts.messages import LeftOut, Manifest, Sample
from core import aws
from core.import_shard import importer, records
from core.pack import seal
from contracts.messages import ImportShard
from core.import_shard.importer import import_shard
from core.partners.licensing import Revocation, revoke
from core.provenance import Affected, affected_by, lineage_of
from core.import_shard.settings import ImportSettings
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished, on_shard_sealed
from tests.functions.import_helpers import IMG2DATASET, run_img2dataset, sample_of, webdataset_tar
from tests.functions.pack_helpers import check_shard, sealed_record, sealed_shards
from tests.support import hue_turned

BATCH = "batch-1"
# 4, 11 and 12 are within 3 dHash bits of earlier pictures of other colours: left out, so that
# only the near-duplicate tests depend on the colour signature telling them apart
ITEMS = [item for n, item in enumerate(make_catalog(16, seed=3)) if n not in (4, 11, 12)]


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


@pytest.fixture
def settings(stack: Provisioned, partner: str, function_env: Callable) -> ImportSettings:
    function_env("ImportFunction")
    base = ImportSettings.from_env()
    return dataclasses.replace(base, chunk_bytes=6 << 10,
                               pack=dataclasses.replace(base.pack, min_part_bytes=4 << 10, part_bytes=8 << 10))


def put_tar(stack: Provisioned, name: str, body: bytes) -> ImportShard:
    bucket = stack.outputs["DataBucketName"]
    boto3.client("s3").put_object(Bucket=bucket, Key=f"imports/{BATCH}/{name}", Body=body)
    return ImportShard(batch_id=BATCH, bucket=bucket, key=f"imports/{BATCH}/{name}", partner="partner-a",
                       license="CC-BY-4.0")


def start_batch(stack: Provisioned, total: int) -> None:
    aws.put_item(stack.outputs["PipelineTableName"], records.batch_item(BATCH, "partner-a", "CC-BY-4.0", "tests", total))


def quarantined(stack: Provisioned) -> dict[str, str]:
    return {i["pk"].rsplit("#", 1)[1]: i["reason"] for i in aws.scan_prefix(stack.outputs["PipelineTableName"], "UPLOAD#")
            if i["status"] == "quarantined"}


def announced(stack: Provisioned) -> list[dict]:
    source = next(s for s in stack.sources if s.function == "StartTrainingFunction" and "ShardSealed" in s.rule_arn)
    sqs, found = boto3.client("sqs"), []
    while messages := sqs.receive_message(QueueUrl=source.queue_url, MaxNumberOfMessages=10).get("Messages"):
        found += [json.loads(m["Body"]) for m in messages]
        sqs.delete_message_batch(QueueUrl=source.queue_url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
    return found


def ingest_upload(stack: Provisioned, function_env: Callable, key: str, body: bytes) -> None:
    """An upload accepted by ingest, as a partner's upload would be."""
    from contracts.messages import UploadRef
    from core.ingest.admission import ingest_upload as ingest
    from core.ingest.settings import IngestSettings
    function_env("IngestFunction")
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key=key, Body=body)
    assert ingest(UploadRef(bucket=stack.outputs["UploadsBucketName"], key=key), IngestSettings.from_env()).status == "accepted"
    function_env("ImportFunction")


# --- validation and quarantine ---------------------------------------------------------------------

def test_a_shard_with_bad_samples_keeps_the_good_ones_and_says_why_for_the_rest(stack, settings) -> None:
    # GIVEN a tar of four good samples, a corrupt image, a sample without image, and one without caption
    no_caption = sample_of("s6", ITEMS[5])
    del no_caption["txt"]
    no_caption["json"] = b'{"url": "https://example.org/s6"}'
    body = webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(4)] + [
        {"__key__": b"bad", "webp": ITEMS[4].image[:200] + b"\0" * 50, "txt": b"broken"},  # a corrupt member
        {"__key__": b"lonely", "txt": b"a caption without its picture"},
        no_caption])
    # WHEN it is imported
    report = import_shard(put_tar(stack, "mixed.tar", body), settings)
    # THEN five samples are in the shard, the two bad ones are quarantined with their reasons
    assert (report.status, report.samples_read, report.accepted, report.captions_missing) == ("imported", 7, 5, 1)
    assert report.quarantined == {"corrupt": 1, "no_image": 1}
    assert quarantined(stack) == {"bad": "corrupt", "lonely": "no_image"}


def test_the_imported_shard_is_a_packed_shard_byte_for_byte_with_a_matching_index(stack, settings) -> None:
    body = webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(6)])
    report = import_shard(put_tar(stack, "good.tar", body), settings)
    [(shard_id, shard)] = sealed_shards(settings.pack).items()
    assert shard_id == report.shard_id
    samples = {i["pk"].removeprefix("SAMPLE#"): i for i in aws.scan_prefix(settings.ingest.table, "SAMPLE#")}
    from contracts.messages import Sample
    check_shard(settings.pack, shard_id, shard, {k: Sample.model_validate_json(i["record"]) for k, i in samples.items()})
    assert {i.get("packed_in") for i in samples.values()} == {shard_id}
    # provenance and license in every record, the source URL from the tar's own metadata
    records_in_shard = [json.loads(data) for name, data in shard.members if name.endswith(".json")]
    assert {(r["partner"], r["license"], r["bucket"]) for r in records_in_shard} == {
        ("partner-a", "CC-BY-4.0", stack.outputs["DataBucketName"])}
    assert sorted(r["source"] for r in records_in_shard) == sorted(
        f"https://example.org/s{n}.{ITEMS[n].name.rsplit('.', 1)[1]}" for n in range(6))
    assert sorted(r["caption"] for r in records_in_shard) == sorted(ITEMS[n].sidecar["caption"] for n in range(6))
    [event] = announced(stack)
    assert (event["source"], event["detail-type"], event["detail"]["shard_id"], event["detail"]["samples"]) == (
        "atelier.pack", "Shard Sealed", shard_id, 6)


def test_imported_samples_are_the_partner_s_in_its_report_and_in_status_apart_from_uploads(
        stack, settings, function_env) -> None:
    from atelier import client, reports
    # GIVEN one upload and an imported tar of two good samples and a corrupt one, all partner-a's
    ingest_upload(stack, function_env, "partner-a/mine.png", ITEMS[5].image)
    body = webdataset_tar([sample_of("s0", ITEMS[0]), sample_of("s1", ITEMS[1]),
                           {"__key__": b"bad", "webp": ITEMS[4].image[:200] + b"\0" * 50, "txt": b"broken"}])
    report = import_shard(put_tar(stack, "laion.tar", body), settings)
    assert (report.accepted, report.quarantined) == (2, {"corrupt": 1})

    # THEN the partner report counts both origins, each sample labelled with its own
    partner = reports.partner_report(stack.outputs, "partner-a")
    assert (partner["uploads"], partner["imported"], partner["accepted"], partner["packed"]) == (1, 3, 3, 2)
    assert partner["by_origin"] == {"upload": {"items": 1, "accepted": 1, "packed": 0},
                                    "import": {"items": 3, "accepted": 2, "packed": 2}}
    assert partner["rejected"] == {"corrupt": 1}
    assert {(i["key"], i["origin"], i["status"], bool(i["shard"])) for i in partner["items"]} == {
        ("partner-a/mine.png", "upload", "accepted", False),
        (f"imports/{BATCH}/laion.tar#s0", "import", "accepted", True),
        (f"imports/{BATCH}/laion.tar#s1", "import", "accepted", True),
        (f"imports/{BATCH}/laion.tar#bad", "import", "quarantined", False)}
    # and status counts the import's refusals as the import's, not as quarantined uploads
    status = client.pipeline_status(stack.outputs)
    assert (dict(status.uploads), dict(status.quarantined)) == ({"accepted": 1}, {})
    assert (status.imported, dict(status.imports_quarantined), status.samples) == (2, {"corrupt": 1}, 3)


def test_img2dataset_s_own_fields_are_in_the_shard_s_records_for_its_tools(stack, settings) -> None:
    exif = json.dumps({"Image Make": "Atelier", "Image Model": "procedural"})
    fields = {"status": "success", "original_width": 640, "original_height": 480, "exif": exif}
    body = webdataset_tar([sample_of("000000012", ITEMS[0], **fields, error_message=None, extra={"nested": 1}),
                           sample_of("000000013", ITEMS[1], status="success", exif="x" * (20 << 10))])
    import_shard(put_tar(stack, "i2d.tar", body), settings)
    [shard] = sealed_shards(settings.pack).values()
    records = {r["key"]: r for r in (json.loads(data) for name, data in shard.members if name.endswith(".json"))}
    first, second = records["000000012"], records["000000013"]
    # img2dataset's fields at the top level, as its tools read them; `key` is its sample key
    assert {k: first[k] for k in ("url", "key", *fields)} == {
        "url": f"https://example.org/000000012.{ITEMS[0].name.rsplit('.', 1)[1]}", "key": "000000012", **fields}
    # ours stay beside them: the provenance pointer moves to upload_key, the URL is also `source`
    assert first["upload_key"] == f"imports/{BATCH}/i2d.tar#000000012" and first["source"] == first["url"]
    assert first["partner"] == "partner-a" and first["width"] == 96 and "extra" not in first
    # an EXIF block past the bound is left out, the rest kept
    assert "exif" not in second and second["status"] == "success" and second["key"] == "000000013"


def test_a_duplicate_of_another_partner_s_sample_names_no_key_of_theirs(stack, settings, function_env) -> None:
    ingest_upload(stack, function_env, "partner-a/secret-name.png", ITEMS[0].image)
    item = aws.get_item(settings.ingest.table, f"SAMPLE#{hashlib.sha256(ITEMS[0].image).hexdigest()}")
    first = Sample.model_validate_json(item["record"])
    aws.put_item(settings.ingest.table, {**item, "record": first.model_copy(update={"partner": "partner-b"}).model_dump_json()})
    import_shard(put_tar(stack, "dup.tar", webdataset_tar([sample_of("same", ITEMS[0])])), settings)
    [detail] = [i["detail"] for i in aws.scan_prefix(settings.ingest.table, "UPLOAD#") if i.get("reason") == "duplicate"]
    assert detail == "same bytes as a sample already in the dataset" and "secret-name" not in detail


def test_a_truncated_tar_keeps_the_samples_before_the_break(stack, settings) -> None:
    body = webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(4)])
    cut = body[:len(body) // 2 + 100]  # inside the members of a later sample
    report = import_shard(put_tar(stack, "cut.tar", cut), settings)
    assert report.truncated and report.quarantined == {"truncated": 1}
    assert report.accepted == report.samples_read - 1 >= 1 and report.status == "imported"


def test_a_tar_cut_at_a_member_boundary_loses_only_its_last_sample(stack, settings) -> None:
    body = webdataset_tar([sample_of(f"s{n}", ITEMS[n]) for n in range(4)]).rstrip(b"\0")  # no end blocks
    report = import_shard(put_tar(stack, "cut-clean.tar", body), settings)
    assert (report.truncated, report.quarantined, report.accepted) == (True, {"truncated": 1}, 3)


def test_an_object_that_is_not_a_tar_is_rejected_whole(stack, settings) -> None:
    report = import_shard(put_tar(stack, "page.tar", b"<html>not a tar</html>" * 40), settings)
    assert (report.status, report.reason, report.shard_id) == ("rejected", "not_a_tar", None)


def test_a_partner_without_the_license_imports_nothing(stack, settings) -> None:
    message = put_tar(stack, "s.tar", webdataset_tar([sample_of("s0", ITEMS[0])])).model_copy(update={"license": "other"})
    report = import_shard(message, settings)
    assert (report.status, report.reason) == ("rejected", "unlicensed") and sealed_shards(settings.pack) == {}


def table_rows(report: records.BatchReport) -> dict[str, str]:
    """`atelier import-report`'s table as {what: count}."""
    from rich.console import Console

    from atelier.cli_import import report_table
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(report_table(report))
    cells = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line.startswith("│")]
    return {what.strip(): count.strip() for what, count in cells}


def test_width_and_height_from_the_tar_that_disagree_with_the_decoded_image_are_flagged(stack, settings) -> None:
    # GIVEN img2dataset-style .json sizes: right, turned (measured before EXIF orientation), and wrong
    sizes = [Image.open(io.BytesIO(ITEMS[n].image)).size for n in range(3)]
    start_batch(stack, 1)
    body = webdataset_tar([sample_of("right", ITEMS[0], width=sizes[0][0], height=sizes[0][1]),
                           sample_of("turned", ITEMS[1], width=sizes[1][1], height=sizes[1][0]),
                           sample_of("wrong", ITEMS[2], width=sizes[2][0] * 2, height=sizes[2][1])])
    # WHEN it is imported
    report = import_shard(put_tar(stack, "sizes.tar", body), settings)
    # THEN every sample is kept with its decoded size, and the wrong claim is counted in the reports
    assert (report.accepted, report.size_mismatches) == (3, 1)
    batch = records.batch_report(settings.ingest.table, BATCH)
    assert batch.size_mismatches == 1
    assert table_rows(batch)["width/height not the decoded image's (flagged)"] == "1"  # `atelier import-report`
    records_ = [json.loads(i["record"]) for i in aws.scan_prefix(settings.ingest.table, "SAMPLE#")]
    assert sorted((r["width"], r["height"]) for r in records_) == sorted(sizes)


# --- duplicates --------------------------------------------------------------------------------------

def test_duplicates_of_uploaded_images_are_left_out(stack, settings, function_env) -> None:
    # GIVEN two images a partner uploaded and ingest accepted
    ingest_upload(stack, function_env, "partner-a/one.png", ITEMS[0].image)
    ingest_upload(stack, function_env, "partner-a/two.png", ITEMS[1].image)
    again = io.BytesIO()
    Image.open(io.BytesIO(ITEMS[1].image)).convert("RGB").save(again, "JPEG", quality=70)
    resized_with_original_hash = io.BytesIO()
    Image.open(io.BytesIO(ITEMS[0].image)).convert("RGB").resize((90, 90)).save(resized_with_original_hash, "PNG")
    import hashlib
    # WHEN a shard holds the same bytes, a re-encode, img2dataset's resize carrying the original's
    # sha256, the same bytes twice, and two new images
    body = webdataset_tar([
        sample_of("same", ITEMS[0]),
        {"__key__": b"reencoded", "jpg": again.getvalue(), "txt": b"again"},
        {"__key__": b"resized", "png": resized_with_original_hash.getvalue(), "txt": b"resized",
         "json": json.dumps({"sha256": hashlib.sha256(ITEMS[0].image).hexdigest()}).encode()},
        sample_of("new1", ITEMS[2]), sample_of("new1copy", ITEMS[2]), sample_of("new2", ITEMS[3])])
    report = import_shard(put_tar(stack, "dups.tar", body), settings)
    # THEN only the two new images are in the shard
    assert (report.accepted, report.duplicates, report.near_duplicates_found) == (2, 3, 1)
    reasons = quarantined(stack)
    assert (reasons["same"], reasons["resized"], reasons["new1copy"], reasons["reencoded"]) == (
        "duplicate", "duplicate", "duplicate", "near_duplicate")
    [shard] = sealed_shards(settings.pack).values()
    assert len(shard.members) == 6
    assert [(n.key, n.of) for n in report.near_duplicate_samples] == [
        ("reencoded", hashlib.sha256(ITEMS[1].image).hexdigest())]


# --- near duplicates: colour, and what an import does with them ------------------------------------

def near_duplicate_tar(stack: Provisioned, function_env: Callable, mode: str) -> tuple[ImportShard, str]:
    """ITEMS[0] uploaded (its sha256 returned) and a tar of it recoloured (its hue turned at the same
    luminance), of it at 3/4 size re-encoded, and of a new picture, to import with `mode`."""
    ingest_upload(stack, function_env, "partner-a/original.png", ITEMS[0].image)
    original = Image.open(io.BytesIO(ITEMS[0].image)).convert("RGB")
    turned, rescaled = io.BytesIO(), io.BytesIO()
    hue_turned(original, 120).save(turned, "PNG")
    original.resize((72, 72), Image.Resampling.LANCZOS).save(rescaled, "JPEG", quality=80)
    body = webdataset_tar([{"__key__": b"turned", "png": turned.getvalue(), "txt": b"recoloured"},
                           {"__key__": b"rescaled", "jpg": rescaled.getvalue(), "txt": b"smaller"},
                           sample_of("new", ITEMS[1])])
    message = put_tar(stack, f"near-{mode}.tar", body).model_copy(update={"near_duplicates": mode})
    return message, hashlib.sha256(ITEMS[0].image).hexdigest()


def test_the_recoloured_copy_hashes_like_the_original_in_luminance() -> None:
    # what made the colour-blind check leave recolourings out: their dHash is the original's
    from core.ingest import images
    original = Image.open(io.BytesIO(ITEMS[0].image)).convert("RGB")
    assert images.hamming(images.dhash(hue_turned(original, 120)), images.dhash(original)) <= 3


@pytest.mark.parametrize(("mode", "accepted", "left_out", "marked"), [
    pytest.param("drop", {"turned", "new"}, {"rescaled": "near_duplicate"}, set(), id="drop"),
    pytest.param("flag", {"turned", "rescaled", "new"}, {}, {"rescaled"}, id="flag"),
    pytest.param("keep", {"turned", "rescaled", "new"}, {}, set(), id="keep"),
])
def test_a_recoloured_copy_is_a_new_sample_and_a_rescaled_copy_a_near_duplicate_the_mode_decides_on(
        stack, settings, function_env, mode: str, accepted: set[str], left_out: dict[str, str],
        marked: set[str]) -> None:
    # GIVEN an uploaded picture, and a tar of it recoloured, of it rescaled, and of a new picture
    message, original = near_duplicate_tar(stack, function_env, mode)

    # WHEN the tar is imported with --near-duplicates <mode>
    report = import_shard(message, settings)

    # THEN the recolouring is accepted unmarked in every mode; the rescaled copy as the mode says
    records_ = {r.key.rsplit("#", 1)[1]: r for r in (Sample.model_validate_json(i["record"])
                for i in aws.scan_prefix(settings.ingest.table, "SAMPLE#")) if "#" in r.key}
    assert (set(records_), quarantined(stack)) == (accepted, left_out)
    assert {key for key, r in records_.items() if r.near_duplicate_of} == marked
    assert all(records_[key].near_duplicate_of == original for key in marked)
    # AND the report counts and names what it found (in keep mode, nothing is looked for)
    found = [(n.key, n.of) for n in report.near_duplicate_samples]
    assert (report.near_duplicates_found, found) == ((0, []) if mode == "keep" else (1, [("rescaled", original)]))
    assert report.accepted == len(accepted) and report.rejected == 0
    # AND a flagged sample's mark is in the shard's record too
    if marked:
        [shard] = sealed_shards(settings.pack).values()
        in_shard = [json.loads(data) for name, data in shard.members if name.endswith(".json")]
        assert [r["near_duplicate_of"] for r in in_shard if r["near_duplicate_of"]] == [original]


def test_the_import_report_gives_near_duplicates_their_own_row_and_names_them(stack, settings, function_env) -> None:
    from rich.console import Console

    from atelier.cli_import import near_duplicate_table
    start_batch(stack, 1)
    message, original = near_duplicate_tar(stack, function_env, "drop")
    import_shard(message, settings)

    batch = records.batch_report(settings.ingest.table, BATCH)
    rows = table_rows(batch)

    # THEN near duplicates have a row of their own; none is a rejection, nor listed under one
    assert (rows["near duplicate (left out)"], rows["duplicate (left out)"], rows["rejected"]) == ("1", "0", "0")
    assert "near_duplicate" not in rows and batch.rejections == {}
    # AND the second table names the sample and the one it is near
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(near_duplicate_table(batch))
    [line] = [line for line in console.export_text().splitlines() if "rescaled" in line]
    assert "near-drop.tar#rescaled" in line and original[:12] in line


def test_the_cli_sends_its_near_duplicate_mode_with_every_message(stack, settings, tmp_path, monkeypatch,
                                                                  capsys) -> None:
    from atelier import client
    from atelier.cli import main
    from atelier.cli_import import default_batch_id
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    folder = tmp_path / "laion"
    folder.mkdir()
    for n in range(2):
        (folder / f"0000{n}.tar").write_bytes(webdataset_tar([sample_of("a", ITEMS[n])]))
    command = ["import", str(folder), "--partner", "partner-a", "--license", "CC-BY-4.0"]

    # WHEN an import is started with --near-duplicates flag
    assert main(command + ["--near-duplicates", "flag"]) == 0

    # THEN every message carries it, and so does its batch, whose id is not the default mode's
    messages = boto3.client("sqs").receive_message(QueueUrl=stack.outputs["ImportQueueUrl"],
                                                   MaxNumberOfMessages=10)["Messages"]
    assert [ImportShard.model_validate_json(m["Body"]).near_duplicates for m in messages] == ["flag", "flag"]
    batch_id = default_batch_id(str(folder), "partner-a", "CC-BY-4.0", "flag")
    assert batch_id != default_batch_id(str(folder), "partner-a", "CC-BY-4.0")
    assert records.batch_report(settings.ingest.table, batch_id).near_duplicates == "flag"
    # AND that batch cannot be resumed with another mode
    capsys.readouterr()
    assert main(command + ["--batch", batch_id, "--near-duplicates", "drop"]) == 2
    assert f"batch {batch_id} imports with --near-duplicates flag" in capsys.readouterr().err


def test_a_message_without_a_near_duplicate_mode_drops_and_one_with_an_unknown_mode_fails_alone(
        stack, settings, lambda_context) -> None:
    from import_shard.app import lambda_handler
    start_batch(stack, 1)
    message = put_tar(stack, "old.tar", webdataset_tar([sample_of("s0", ITEMS[0])]))
    old = message.model_dump(mode="json")
    del old["near_duplicates"]  # as messages were before the option
    assert ImportShard.model_validate(old).near_duplicates == "drop"
    source = next(s for s in stack.sources if s.function == "ImportFunction")
    event = sqs_event([{"MessageId": "old", "ReceiptHandle": "r", "Body": json.dumps(old), "MD5OfBody": ""},
                       {"MessageId": "bad", "ReceiptHandle": "r", "MD5OfBody": "",
                        "Body": json.dumps({**old, "near_duplicates": "sometimes"})}], source, "us-east-1")

    assert lambda_handler(event, lambda_context) == {"batchItemFailures": [{"itemIdentifier": "bad"}]}
    assert records.batch_report(settings.ingest.table, BATCH).samples_accepted == 1


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
    training = TrainingSettings.from_env()

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
