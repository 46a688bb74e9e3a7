"""What the core.deploy tests share: the stack's DeploySettings, events delivered by hand, updates recorded.

moto runs training jobs to Completed at once and sends no events, and does not implement
UpdateEndpoint: the tests deliver the events themselves (evaluation results as the trainer writes
them) and record UpdateEndpoint calls. tests/e2e/test_deploy_chain.py runs the same steps for real.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from typing import Any, Callable

import boto3
import pytest

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from core import aws
from core.deploy.candidates import on_job_state
from core.deploy.events import JobState, job_state_from_event
from core.deploy.requests import evaluation_job_name
from core.deploy.settings import DeploySettings
from tests.unit.settings_helpers import DEPLOY_REQUIRED
from tests.support import load_event

JOB = "atelier-3f9a1c2b7d4e5f6a8b9c"  # events/deploy_job_*.json
ENDED = 1795953900000
MODELS = "s3://atelier-models-123456789012-us-east-1"  # the stack's models bucket


@pytest.fixture
def settings(stack: Provisioned, function_env: Callable[[str], dict[str, str]]) -> DeploySettings:
    function_env("DeployFunction")
    found = DeploySettings.current()
    put_eval_shard(found.eval_data_uri)
    return found


def put_eval_shard(eval_data_uri: str) -> None:
    """A held-out shard under EvalDataPrefix: without one no evaluation job is started."""
    bucket, _, prefix = eval_data_uri.removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}heldout.tar", Body=bytes(1024))


@pytest.fixture
def updates(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """UpdateEndpoint calls, recorded and applied to moto's endpoint (moto does not implement it)."""
    calls: list[dict[str, Any]] = []
    real_call = aws.sagemaker_call
    real_describe = aws.describe_endpoint
    serving: dict[str, str] = {}

    def call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
        if operation == "update_endpoint":
            calls.append(request)
            serving[request["EndpointName"]] = request["EndpointConfigName"]
            return {}
        return real_call(operation, request)

    def describe(name: str) -> dict[str, Any] | None:
        found = real_describe(name)
        return {**found, "EndpointConfigName": serving.get(name, found["EndpointConfigName"])} if found else None

    monkeypatch.setattr(aws, "sagemaker_call", call)
    monkeypatch.setattr(aws, "describe_endpoint", describe)
    return calls


def completed(name: str = JOB, ended: int = ENDED, **tags: str) -> JobState:
    detail = {**load_event("deploy_job_completed")["detail"], "TrainingJobName": name, "TrainingEndTime": ended,
              "ModelArtifacts": {"S3ModelArtifacts": f"{MODELS}/training/{name}/output/model.tar.gz"},
              "Tags": {"atelier:manifest": "ab" * 32, "atelier:final-stage": "true", **tags}}
    return job_state_from_event(detail)


def evaluation_finished(settings: DeploySettings, model: str, val_loss: float | None,
                        baseline_loss: float | None = None, status: str = "Completed",
                        digest: str = "e" * 64, clip: float | None = None, baseline_clip: float | None = None,
                        measure: str = "", baseline_measure: str | None = None, resolution: int = 32) -> JobState:
    """The evaluation job's end, with the evaluation.json trainer/jobs/evaluate.py writes in its artefact (what
    each loss measures only when `measure` is given: documents of before the gate read it have none)."""
    item = aws.get_item(settings.table, pipeline_table.model_pk(model)) or {}
    name = item.get("eval_job") or evaluation_job_name(model)
    key = f"evaluations/{name}/output/model.tar.gz"
    models: dict[str, Any] = {"candidate": {"val_loss": val_loss, "clip_score": clip}}
    if baseline_loss is not None:
        models["baseline"] = {"val_loss": baseline_loss, "clip_score": baseline_clip}
    for block, stated in (("candidate", measure), ("baseline", measure if baseline_measure is None else baseline_measure)):
        if stated and block in models:
            models[block]["val_loss_measure"] = stated
    document = json.dumps({"schema": 1, "eval_set": {"digest": digest, "samples": 4}, "config": {"resolution": resolution},
                           "models": models}).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("evaluation.json")
        info.size = len(document)
        archive.addfile(info, io.BytesIO(document))
    boto3.client("s3").put_object(Bucket=settings.models_bucket, Key=key, Body=buffer.getvalue())
    return job_state_from_event({
        "TrainingJobName": name, "TrainingJobStatus": status, "TrainingEndTime": ENDED,
        "ModelArtifacts": {"S3ModelArtifacts": f"s3://{settings.models_bucket}/{key}"} if status == "Completed" else None,
        "FailureReason": None if status == "Completed" else "AlgorithmError: no eval shards",
        "Tags": {"atelier:role": "evaluation", "atelier:candidate": model}})


def model_record(settings: DeploySettings, name: str) -> dict[str, Any]:
    return aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}


def training_jobs() -> list[str]:
    return sorted(j["TrainingJobName"] for j in boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"])


def deploy_first(settings: DeploySettings, name: str = JOB, ended: int = ENDED, loss: float = 0.1) -> None:
    """A candidate that passes the gate and creates the endpoint."""
    assert on_job_state(completed(name, ended), settings).action == "evaluating"
    assert on_job_state(evaluation_finished(settings, name, loss), settings).action == "created"


def deploy_settings(**fields: Any) -> DeploySettings:
    """Settings with every variable the template requires (none of the optional ones), these fields changed."""
    return dataclasses.replace(DeploySettings.from_env(DEPLOY_REQUIRED), **fields)
