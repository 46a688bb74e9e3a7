"""atelier.evalset: the held-out evaluation set is licensed, and its tar is a shard the evaluator reads."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import boto3
import pytest
import webdataset as wds

from atelier import cli, client, evalset
from atelier.catalog import LICENSE, make_catalog, write_catalog
from atelier.local.provision import Provisioned

CATALOG = make_catalog(3)  # png, jpg, webp, each with a caption and LICENSE in its sidecar


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_catalog(CATALOG, tmp_path / "heldout")
    return tmp_path / "heldout"


def sidecar(folder: Path, index: int) -> Path:
    return folder / CATALOG[index].sidecar_name


# --- only licensed samples ----------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"caption": "a red circle"},
    {"caption": "a red circle", "license": ""},
    {"caption": "a red circle", "license": "   "},
    {"caption": "a red circle", "license": None},
    {"caption": "a red circle", "license": ["CC-BY-4.0"]},
], ids=["absent", "empty", "blank", "null", "not-text"])
def test_a_sample_without_a_license_refuses_the_whole_folder(folder: Path, fields: dict) -> None:
    sidecar(folder, 1).write_text(json.dumps(fields))

    with pytest.raises(evalset.EvalSetError, match=r"needs a caption and a license"):
        evalset.samples_from_folder(folder, "partner-a", (LICENSE,))


def test_a_caption_file_without_a_sidecar_is_not_a_license(folder: Path) -> None:
    sidecar(folder, 0).unlink()
    (folder / CATALOG[0].name).with_suffix(".txt").write_text("a caption, but no license\n")

    with pytest.raises(evalset.EvalSetError, match=r"needs a caption and a license"):
        evalset.samples_from_folder(folder, "partner-a", (LICENSE,))


def test_a_license_the_partner_does_not_hold_is_refused(folder: Path) -> None:
    sidecar(folder, 2).write_text(json.dumps({"caption": "a square", "license": "CC-BY-NC-4.0"}))

    with pytest.raises(evalset.EvalSetError, match=r"license 'CC-BY-NC-4.0' is not one partner 'partner-a' holds"):
        evalset.samples_from_folder(folder, "partner-a", (LICENSE,))


@pytest.mark.parametrize("text", ["{not json", '["caption", "license"]'], ids=["not-json", "not-an-object"])
def test_a_malformed_sidecar_is_an_evalset_error_not_a_crash(folder: Path, text: str) -> None:
    sidecar(folder, 0).write_text(text)

    with pytest.raises(evalset.EvalSetError, match=CATALOG[0].sidecar_name.split("/")[-1]):
        evalset.samples_from_folder(folder, "partner-a", (LICENSE,))


def test_a_folder_without_images_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text('{"caption": "x", "license": "CC-BY-4.0"}')
    with pytest.raises(evalset.EvalSetError, match="holds no images"):
        evalset.samples_from_folder(tmp_path, "partner-a", (LICENSE,))


# --- the shard ----------------------------------------------------------------------------------

def test_the_tar_holds_image_caption_and_record_of_each_sample_together_in_order(folder: Path) -> None:
    data = evalset.build_tar(evalset.samples_from_folder(folder, "partner-a", (LICENSE,)))

    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
        names = [m.name for m in archive.getmembers()]
    assert names == ["eval000000.png", "eval000000.txt", "eval000000.json", "eval000001.jpg", "eval000001.txt",
                     "eval000001.json", "eval000002.webp", "eval000002.txt", "eval000002.json"]
    for index, item in enumerate(CATALOG):
        key = f"eval{index:06d}"
        assert members[f"{key}.{item.name.rsplit('.', 1)[1]}"] == item.image
        assert members[f"{key}.txt"].decode() == item.sidecar["caption"]
        assert json.loads(members[f"{key}.json"]) == {
            "caption": item.sidecar["caption"], "license": LICENSE, "partner": "partner-a",
            "source": item.sidecar["source"], "sha256": hashlib.sha256(item.image).hexdigest(), "split": "eval"}


def test_the_same_samples_give_the_same_bytes(folder: Path) -> None:
    samples = evalset.samples_from_folder(folder, "partner-a", (LICENSE,))
    assert evalset.build_tar(samples) == evalset.build_tar(list(samples))


def test_webdataset_reads_every_sample_back(folder: Path, tmp_path: Path) -> None:
    shard = tmp_path / "heldout.tar"
    shard.write_bytes(evalset.build_tar(evalset.samples_from_folder(folder, "partner-a", (LICENSE,))))

    read = list(wds.WebDataset(str(shard), shardshuffle=False))

    assert [s["__key__"] for s in read] == ["eval000000", "eval000001", "eval000002"]
    assert [s["txt"].decode() for s in read] == [item.sidecar["caption"] for item in CATALOG]
    assert [json.loads(s["json"])["license"] for s in read] == [LICENSE] * 3


def test_the_evaluator_reads_every_sample_with_its_caption(folder: Path, tmp_path: Path) -> None:
    from trainer.data.eval_set import read_eval_samples
    shard = tmp_path / "eval" / "heldout.tar"
    shard.parent.mkdir()
    shard.write_bytes(evalset.build_tar(evalset.samples_from_folder(folder, "partner-a", (LICENSE,))))

    samples, problems = read_eval_samples([shard], resolution=32, max_samples=10)

    assert problems == []
    assert [s.caption for s in samples] == [item.sidecar["caption"] for item in CATALOG]


# --- `atelier evalset add` -----------------------------------------------------------------------

@pytest.fixture
def outputs(stack: Provisioned, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    return stack.outputs


def eval_objects(outputs: dict[str, str]) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=outputs["DataBucketName"], Prefix="eval/")
    return [o["Key"] for o in listed.get("Contents", [])]


def printed(capsys: pytest.CaptureFixture[str]) -> str:
    """What the command wrote to stderr, unwrapped (rich breaks lines at the terminal's width)."""
    return " ".join(capsys.readouterr().err.split())


def test_evalset_add_writes_one_tar_under_the_eval_prefix(outputs, partner: str, folder: Path) -> None:
    assert cli.main(["evalset", "add", str(folder), "--partner", partner]) == 0

    body = boto3.client("s3").get_object(Bucket=outputs["DataBucketName"], Key="eval/heldout.tar")["Body"].read()
    assert body == evalset.build_tar(evalset.samples_from_folder(folder, partner, (LICENSE,)))


def test_evalset_add_for_an_unregistered_partner_writes_nothing(outputs, folder: Path, capsys) -> None:
    assert cli.main(["evalset", "add", str(folder), "--partner", "partner-z"]) == 2
    assert "not registered" in printed(capsys) and eval_objects(outputs) == []


def test_evalset_add_with_a_license_the_partner_lacks_writes_nothing(outputs, partner: str, folder: Path,
                                                                     capsys) -> None:
    sidecar(folder, 1).write_text(json.dumps({"caption": "a circle", "license": "All-Rights-Reserved"}))

    assert cli.main(["evalset", "add", str(folder), "--partner", partner]) == 2
    assert "is not one partner 'partner-a' holds" in printed(capsys) and eval_objects(outputs) == []
