"""Deploy on the local stack, for real: evaluation jobs run the trainer's evaluation in the training
container, the endpoint updates blue/green and rolls back on its alarm.

One stack: the demo chain deploys model A; the tests then deliver further training-job events in
order (each builds on the endpoint the previous one left): a Stopped job, a duplicate, a worse
model, a better one, a rollback by hand and an automatic rollback. The stack signs served images
(`local up --sign`: a local CA's certificate in the secret C2paSigningSecretArn names).
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import boto3
import pytest
import torch
from botocore.exceptions import ClientError
from PIL import Image
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from atelier.demo import DemoOptions, drive
from atelier.local import signing
from atelier.local.stack import LocalStack, StackOptions
from contracts import pipeline_table
from core import aws
from tests.support import c2pa_assertions, quick_training, read_c2pa

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=110)]
REPO = Path(__file__).resolve().parents[2]
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, str]]:
    state = tmp_path_factory.mktemp("stack")
    with LocalStack(StackOptions(root=REPO, state_dir=state, moto_port=0, sagemaker_port=0,
                                 **quick_training(), sign_images=True)) as stack:
        result = drive(stack, DemoOptions(root=REPO, state_dir=state, output=state / "a.png", images=16,
                                          stage_timeout_s=420))
        yield stack, next(j["name"] for j in result[0]["config"]["jobs"] if j["role"] == "train")  # not its encode job


@pytest.fixture(autouse=True)
def stack_env(deployed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in deployed[0].env.items():
        monkeypatch.setenv(key, value)
    aws.reset_clients()


# --- helpers --------------------------------------------------------------------------------------

def outputs(stack: LocalStack) -> dict[str, str]:
    return stack.outputs


def wait_for(what: str, check: Callable[[], Any], stack: LocalStack, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check()
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; logs in {stack.options.state_dir / 'logs'}")


def model(stack: LocalStack, name: str) -> dict[str, Any]:
    return aws.get_item(stack.outputs["PipelineTableName"], pipeline_table.model_pk(name)) or {}


def settled(stack: LocalStack, name: str, statuses: set[str]) -> dict[str, Any]:
    return wait_for(f"{name} in {statuses}", lambda: (m := model(stack, name)).get("status") in statuses and m, stack)


def serving(stack: LocalStack) -> str:
    endpoint = boto3.client("sagemaker").describe_endpoint(EndpointName=stack.outputs["EndpointName"])
    return endpoint["EndpointConfigName"] if endpoint["EndpointStatus"] == "InService" else ""


def deploy_queue_drained(stack: LocalStack) -> bool:
    """Every event for the deploy function delivered and handled (its delivery queues are empty)."""
    sqs = boto3.client("sqs")
    for source in stack.provisioned.sources:
        if source.function != "DeployFunction":
            continue
        counts = sqs.get_queue_attributes(QueueUrl=source.queue_url, AttributeNames=["All"])["Attributes"]
        if int(counts["ApproximateNumberOfMessages"]) or int(counts["ApproximateNumberOfMessagesNotVisible"]):
            return False
    return True


def copy_artefact(stack: LocalStack, source_job: str, job: str, damage: float = 0.0) -> str:
    """A model artefact for `job`: source_job's, or with its UNet weights pushed off by `damage`."""
    s3, bucket = boto3.client("s3"), stack.outputs["ModelsBucketName"]
    original = s3.get_object(Bucket=bucket, Key=f"training/{source_job}/output/model.tar.gz")["Body"].read()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(original), mode="r:gz") as source, \
            tarfile.open(fileobj=buffer, mode="w:gz") as target:
        for info in source:
            data = source.extractfile(info).read() if info.isfile() else None
            if damage and info.name.removeprefix("./") == UNET_WEIGHTS:
                generator = torch.Generator().manual_seed(0)
                weights = {k: v + damage * torch.randn(v.shape, generator=generator, dtype=v.dtype)
                           for k, v in load_safetensors(data).items()}
                data = save_safetensors(weights)
                info.size = len(data)
            target.addfile(info, io.BytesIO(data) if data is not None else None)
    key = f"training/{job}/output/model.tar.gz"
    s3.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())
    return f"s3://{bucket}/{key}"


def job_event(stack: LocalStack, job: str, status: str, model_data: str | None, ended_ms: int) -> None:
    """The training-job state change SageMaker would send (these jobs were trained elsewhere)."""
    detail = {"TrainingJobName": job, "TrainingJobStatus": status, "TrainingEndTime": ended_ms,
              "ModelArtifacts": {"S3ModelArtifacts": model_data} if model_data else None,
              "FailureReason": None if status == "Completed" else "MaxRuntimeExceeded",
              "Tags": {"atelier:manifest": "cd" * 32, "atelier:final-stage": "true"}}
    entry = {"Source": "aws.sagemaker", "DetailType": "SageMaker Training Job State Change",
             "Detail": json.dumps(detail), "Resources": []}
    assert boto3.client("events").put_events(Entries=[entry])["FailedEntryCount"] == 0


def now_ms() -> int:
    return int(time.time() * 1000)


def served_png(stack: LocalStack) -> bytes:
    body = json.dumps({"prompt": "a red circle on a blue background", "num_inference_steps": 2, "seed": 3})
    response = boto3.client("sagemaker-runtime").invoke_endpoint(
        EndpointName=stack.outputs["EndpointName"], ContentType="application/json", Accept="image/png", Body=body)
    return response["Body"].read()


def png_model_id(stack: LocalStack) -> str:
    return Image.open(io.BytesIO(served_png(stack))).text["atelier:model-id"]


# --- the story, in order ----------------------------------------------------------------------------

def test_the_demo_model_passed_the_gate_and_serves(deployed: Any) -> None:
    stack, first = deployed
    record = settled(stack, first, {"deployed"})
    gate = json.loads(record["gate"])
    assert gate["decision"] == "passed" and gate["production"] is None
    assert float(gate["scores"]["val_loss"]) > 0
    assert serving(stack) == first and png_model_id(stack) == first


def test_the_served_png_carries_a_c2pa_manifest_that_verifies(deployed: Any) -> None:
    stack, first = deployed
    anchors = (stack.options.state_dir / signing.ROOT_FILE).read_text()

    state, manifest, failures = read_c2pa(served_png(stack), anchors)

    assert (state, failures) == ("Trusted", [])
    assert c2pa_assertions(manifest)["atelier.provenance"]["model_id"] == first
    model = boto3.client("sagemaker").describe_model(ModelName=first)
    assert model["PrimaryContainer"]["Environment"]["ATELIER_C2PA_SECRET"].startswith("arn:aws:secretsmanager:")
    assert model["EnableNetworkIsolation"] is False  # the server read its secret with the role's credentials


def test_a_stopped_job_is_recorded_and_never_deployed(deployed: Any) -> None:
    stack, first = deployed
    job_event(stack, "atelier-stopped-0001", "Stopped", copy_artefact(stack, first, "atelier-stopped-0001"), now_ms())

    wait_for("the deploy events handled", lambda: deploy_queue_drained(stack), stack)
    assert model(stack, "atelier-stopped-0001") == {}
    assert serving(stack) == first


def test_a_duplicate_completed_event_deploys_once(deployed: Any) -> None:
    stack, first = deployed
    before = model(stack, first)
    described = boto3.client("sagemaker").describe_training_job(TrainingJobName=first)

    job_event(stack, first, "Completed", described["ModelArtifacts"]["S3ModelArtifacts"],
              int(described["TrainingEndTime"].timestamp() * 1000))

    wait_for("the deploy events handled", lambda: deploy_queue_drained(stack), stack)
    assert model(stack, first) == before
    assert serving(stack) == first


def test_a_worse_model_is_held_back(deployed: Any) -> None:
    stack, first = deployed
    job_event(stack, "atelier-worse-0001", "Completed", copy_artefact(stack, first, "atelier-worse-0001", damage=0.5),
              now_ms())

    record = settled(stack, "atelier-worse-0001", {"held-back", "deployed", "eval-failed"})

    gate = json.loads(record.get("gate") or "{}")
    assert record["status"] == "held-back", record.get("reason")
    assert float(gate["scores"]["val_loss"]) > float(gate["production"]["val_loss"])
    assert gate["production_model"] == first
    assert serving(stack) == first


def test_an_equal_model_trained_later_replaces_production(deployed: Any) -> None:
    stack, first = deployed
    job_event(stack, "atelier-better-0001", "Completed", copy_artefact(stack, first, "atelier-better-0001"), now_ms())

    settled(stack, "atelier-better-0001", {"deployed", "held-back", "eval-failed"})
    wait_for("the new model serving", lambda: serving(stack) == "atelier-better-0001", stack)

    assert png_model_id(stack) == "atelier-better-0001"
    assert model(stack, "atelier-better-0001")["status"] == "deployed"


def test_the_endpoint_rejects_a_malformed_request(deployed: Any) -> None:
    stack, _ = deployed
    with pytest.raises(ClientError) as raised:
        boto3.client("sagemaker-runtime").invoke_endpoint(
            EndpointName=stack.outputs["EndpointName"], ContentType="application/json", Body=b'{"prompt": 3}')
    assert raised.value.response["Error"]["Code"] == "ModelError"
    assert "prompt" in raised.value.response["Error"]["Message"]


def test_rollback_by_hand_restores_the_previous_model(deployed: Any) -> None:
    stack, first = deployed
    from atelier.cli import main

    assert main(["rollback", "--reason", "e2e"]) == 0

    wait_for("the first model serving again", lambda: serving(stack) == first, stack)
    assert png_model_id(stack) == first
    assert model(stack, "atelier-better-0001")["status"] == "rolled-back"


def test_an_alarm_during_the_rollout_rolls_back_on_its_own(deployed: Any) -> None:
    stack, first = deployed
    alarm = next(a for a in aws_alarm_names(stack) if a.endswith("endpoint-5xx"))
    job_event(stack, "atelier-alarmed-0001", "Completed", copy_artefact(stack, first, "atelier-alarmed-0001"), now_ms())
    settled(stack, "atelier-alarmed-0001", {"deployed", "held-back", "eval-failed"})
    cloudwatch = boto3.client("cloudwatch")

    # WHEN the 5xx alarm fires while the new fleet takes traffic or bakes (held in ALARM: the local
    # alarm evaluator, like CloudWatch, would otherwise set it back from the metrics)
    def alarmed_and_rolled_back() -> dict[str, Any] | None:
        cloudwatch.set_alarm_state(AlarmName=alarm, StateValue="ALARM", StateReason="e2e: errors")
        record = model(stack, "atelier-alarmed-0001")
        return record if record.get("status") == "rolled-back" else None

    record = wait_for("an automatic rollback", alarmed_and_rolled_back, stack)
    cloudwatch.set_alarm_state(AlarmName=alarm, StateValue="OK", StateReason="e2e: reset")

    # THEN SageMaker returned traffic to the old model and the pipeline recorded the rollback
    assert serving(stack) == first
    assert "automatically" in record["reason"]


def aws_alarm_names(stack: LocalStack) -> list[str]:
    return [a["AlarmName"] for a in boto3.client("cloudwatch").describe_alarms()["MetricAlarms"]]
