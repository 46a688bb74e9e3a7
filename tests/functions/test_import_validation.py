"""ImportFunction under moto: existing WebDataset tars validated, bad samples quarantined with their reasons."""

from __future__ import annotations

import hashlib
import io
import json

from PIL import Image

from contracts.messages import Sample
from core import aws
from core.import_shard import importer, records
from core.import_shard.importer import import_shard
from tests.functions.import_function_helpers import (  # noqa: F401  (small_parts, settings: fixtures)
    BATCH,
    ITEMS,
    announced,
    ingest_upload,
    put_tar,
    quarantined,
    settings,
    small_parts,
    start_batch,
    table_rows,
)
from tests.functions.import_helpers import sample_of, webdataset_tar
from tests.functions.pack_helpers import check_shard, sealed_shards


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
