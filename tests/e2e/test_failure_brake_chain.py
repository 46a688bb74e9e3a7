"""A job that always fails, on the local stack: each failure backs the lineage off, the second in a
row halts it (TRAINING_MAX_CONSECUTIVE_FAILURES=2), nothing more starts however long we wait, `atelier
status` says why, and `atelier lineage resume main` starts the next job at once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import boto3
import pytest

from atelier import client
from atelier.catalog import LICENSE, make_catalog, write_catalog
from atelier.local.stack import LocalStack, StackOptions

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=35)]
REPO = Path(__file__).resolve().parents[2]
# a VAE channel the job does not have: only the container can see that, so every job fails at start, the
# same way, as a hyperparameter naming a missing channel would on AWS (the function checks every value it can)
FAILING = {"TrainingQuota": "1", "EncodeInstanceType": "", "AutoencoderInstanceType": "",
           "TrainingRetrySchedule": "rate(1 minute)"}
FAILING_ENVIRONMENT = {"SHARD_MAX_SAMPLES": "4", "TRAINING_MAX_CONSECUTIVE_FAILURES": "2",
                       "TRAINING_FAILURE_BACKOFF_S": "2"}
FAILING_RECIPE = {"training": {"hyperparameters": {"steps": "2", "batch-size": "2", "resolution": "32",
                                                   "vae": "elsewhere", "num-workers": "0"}}}


CAUSE = "elsewhere is neither a directory nor a channel (no SM_CHANNEL_ELSEWHERE)"


def wait_for(reached: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := reached()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
    return value


def train_jobs(stack: LocalStack) -> list[dict]:
    return [j for j in client.pipeline_status(stack.outputs).jobs if j["role"] == "train"]


def test_a_job_that_always_fails_halts_its_lineage_until_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # schedules every 3 s instead of every minute, so the backoff's end is seen within seconds
    with LocalStack(StackOptions(root=REPO, state_dir=tmp_path / "stack", moto_port=0, sagemaker_port=0,
                                 overrides=FAILING, recipe=FAILING_RECIPE, environment=FAILING_ENVIRONMENT,
                                 schedule_scale=0.05)) as stack:
        for key, value in stack.env.items():
            monkeypatch.setenv(key, value)
        client.add_partner(stack.outputs, "acme", [LICENSE], [], "e2e")
        write_catalog(make_catalog(4), tmp_path / "catalog")
        list(client.upload(tmp_path / "catalog", "acme", stack.outputs["UploadsBucketName"]))

        # WHEN its jobs fail: the first backs off 2 s, the schedule starts the retry, that fails too
        def halted() -> dict | None:
            return next((line for line in client.pipeline_status(stack.outputs).lineages
                         if line["held"] and line["held"].startswith("halted")), None)
        lineage = wait_for(halted, 300, "the lineage to halt")

        # THEN exactly two jobs ran, each failed with the trainer's reason, and the shard waits
        jobs = train_jobs(stack)
        assert [j["status"] for j in jobs] == ["Failed", "Failed"]
        assert all(CAUSE in (j["failure"] or "") for j in jobs), jobs
        assert lineage["name"] == "main" and lineage["model_failures"] == 2
        assert CAUSE in lineage["held"]
        time.sleep(10)  # three more schedule ticks start nothing
        assert len(train_jobs(stack)) == 2
        assert client.pipeline_status(stack.outputs).shards.get("pending") == 1

        # WHEN an operator resumes it
        from atelier.cli import main
        assert main(["lineage", "resume", "main"]) == 0

        # THEN the next job starts (and, the cause unfixed, fails and backs off again)
        wait_for(lambda: len(train_jobs(stack)) == 3, 120, "the job after the resume")
        record = boto3.client("dynamodb").get_item(TableName=stack.outputs["PipelineTableName"],
                                                   Key={"pk": {"S": "LINEAGE#main"}})["Item"]
        assert len(record["failures"]["L"]) >= 2
