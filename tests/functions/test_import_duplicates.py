"""ImportFunction under moto: duplicates of uploads left out, near duplicates by colour and the import's mode."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Callable

import boto3
import pytest
from PIL import Image

from atelier.local.provision import Provisioned
from atelier.local.runtime import sqs_event
from contracts.messages import Sample
from core import aws
from core.import_shard import importer, records
from contracts.messages import ImportShard
from core.import_shard.importer import import_shard
from tests.functions.import_function_helpers import (  # noqa: F401  (small_parts, settings: fixtures)
    BATCH,
    ITEMS,
    ingest_upload,
    put_tar,
    quarantined,
    settings,
    small_parts,
    start_batch,
    table_rows,
)
from tests.functions.import_helpers import sample_of, webdataset_tar
from tests.functions.pack_helpers import sealed_shards
from tests.support import hue_turned


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
