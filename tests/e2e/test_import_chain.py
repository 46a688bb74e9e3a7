"""Import on the local stack: img2dataset's shards and hand-written tars (a corrupt member, a
duplicate of an uploaded image, a cut tar) -> `atelier import --wait` -> quota -> a training job
Completed on the imported shards."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from atelier import client
from atelier.catalog import LICENSE, make_catalog
from atelier.local.stack import LocalStack, StackOptions
from tests.functions.import_helpers import IMG2DATASET, run_img2dataset, sample_of, webdataset_tar
from tests.support import quick_training

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not IMG2DATASET.exists(), reason="img2dataset is not installed")]
REPO = Path(__file__).resolve().parents[2]
PARTNER = "laion-partner"
ITEMS = [item for n, item in enumerate(make_catalog(16, seed=3)) if n not in (4, 11, 12)]  # no near duplicates


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, dict]]:
    state = tmp_path_factory.mktemp("stack")
    folder = tmp_path_factory.mktemp("source")
    with LocalStack(StackOptions(root=REPO, state_dir=state, moto_port=0, sagemaker_port=0,
                                 **quick_training())) as stack:
        # GIVEN a registered partner who uploaded one image, and a folder of shards: img2dataset's
        # own output (2 tars) and hand-written ones with a corrupt member, that upload again, a cut tar
        client.add_partner(stack.outputs, PARTNER, [LICENSE], [], "e2e")
        upload = folder.parent / "upload.png"
        upload.write_bytes(ITEMS[0].image)
        list(client.upload(upload, PARTNER, stack.outputs["UploadsBucketName"]))
        run_img2dataset(ITEMS[1:7], folder / "i2d", per_shard=3)
        bad = {"__key__": b"bad", "png": ITEMS[7].image[:120] + bytes(40), "txt": b"corrupt"}
        (folder / "hand" ).mkdir()
        (folder / "hand" / "corrupt.tar").write_bytes(webdataset_tar([sample_of("ok", ITEMS[8]), bad]))
        (folder / "hand" / "duplicate.tar").write_bytes(webdataset_tar([sample_of("up", ITEMS[0]), sample_of("new", ITEMS[9])]))
        whole = webdataset_tar([sample_of(f"t{n}", ITEMS[n]) for n in (10, 11, 12)])
        (folder / "hand" / "cut.tar").write_bytes(whole[:len(whole) - 2000])
        _wait(lambda: client.pipeline_status(stack.outputs).samples >= 1, 120, "the upload to be ingested")
        # WHEN the folder is imported and waited for
        from atelier.cli import main
        assert main(["import", str(folder), "--partner", PARTNER, "--license", LICENSE, "--wait", "--json",
                     "--batch", "e2e"]) == 0
        yield stack, {"folder": folder}


@pytest.fixture(autouse=True)
def stack_env(imported: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in imported[0].env.items():
        monkeypatch.setenv(key, value)


def _wait(reached: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not reached():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


def test_the_report_counts_every_sample_by_outcome(imported: Any) -> None:
    from core.import_shard import records
    stack, _ = imported
    report = records.batch_report(stack.outputs["PipelineTableName"], "e2e")
    assert (report.shards_total, report.shards_done, report.shards_rejected) == (5, 5, 0)
    assert report.reasons == {"corrupt": 1, "duplicate": 1, "truncated": 1}
    assert report.samples_accepted == 6 + 1 + 1 + 2
    assert sum(s.truncated for s in report.shards) == 1


def test_a_training_job_completes_on_the_imported_shards(imported: Any) -> None:
    from core.import_shard import records
    stack, _ = imported
    report = records.batch_report(stack.outputs["PipelineTableName"], "e2e")
    imported_ids = {s.shard_id for s in report.shards if s.shard_id}
    sagemaker = boto3.client("sagemaker")

    def completed() -> list[dict]:
        jobs = sagemaker.list_training_jobs()["TrainingJobSummaries"]
        failed = [j for j in jobs if j["TrainingJobStatus"] in {"Failed", "Stopped"}]
        assert not failed, failed
        return [j for j in jobs if j["TrainingJobStatus"] == "Completed"]

    _wait(lambda: bool(completed()), 600, "a training job to complete")
    job = sagemaker.describe_training_job(TrainingJobName=completed()[0]["TrainingJobName"])
    bucket, key = job["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"].removeprefix("s3://").split("/", 1)
    manifest = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    assert {name.removesuffix(".tar") for name in manifest[1:]} <= imported_ids
