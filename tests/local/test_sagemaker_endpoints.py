"""The local SageMaker's endpoints through boto3: in service, isolation, updates and rollback, errors; its shutdown."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from botocore.exceptions import ClientError

from atelier.local.sagemaker import LocalSageMaker
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    aws,
    error_of,
    invoke,
    moto_url,
    overrides,
    pid_alive,
    put_model,
    put_shards,
    runtime,
    s3,
    service,
    sm,
    training_request,
    wait_for,
    wait_for_endpoint,
)


# --- endpoints ----------------------------------------------------------------------------------

def test_endpoint_goes_in_service_and_serves_the_model(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1", {"FAKE_READY_DELAY": "0.5"})

    arn = sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")["EndpointArn"]

    assert arn == "arn:aws:sagemaker:us-east-1:123456789012:endpoint/atelier"
    assert sm.describe_endpoint(EndpointName="atelier")["EndpointStatus"] == "Creating"
    endpoint = wait_for_endpoint(sm, "atelier", "InService", "Failed")
    assert endpoint["EndpointStatus"] == "InService"
    assert endpoint["EndpointConfigName"] == "model-v1"
    assert endpoint["ProductionVariants"][0]["VariantName"] == "AllTraffic"
    assert endpoint["ProductionVariants"][0]["CurrentInstanceCount"] == 1
    assert invoke(runtime, "atelier", "a red fox") == (
        {"prompt": "a red fox", "model": "v1", "accept": "image/png"}, "application/json")
    assert [e["EndpointName"] for e in sm.list_endpoints()["Endpoints"]] == ["atelier"]


def test_a_network_isolated_container_gets_no_aws_credentials(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    # AWS: with EnableNetworkIsolation "no AWS credentials are made available to the container runtime
    # environment" (docs/aws-differences.md); the model's own Environment is passed all the same
    put_model(s3, sm, "isolated", "v1", {"AWS_MINE": "kept"}, isolated=True)
    put_model(s3, sm, "open", "v1")

    for name in ("isolated", "open"):
        sm.create_endpoint(EndpointName=name, EndpointConfigName=name)
    for name in ("isolated", "open"):
        wait_for_endpoint(sm, name, "InService")

    given = {name: json.loads(next(service.settings.state_dir.glob(f"endpoints/{name}/{name}/opt_ml/serve.aws.json"))
                              .read_text()) for name in ("isolated", "open")}
    assert given["isolated"] == {"AWS_MINE": "kept", "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                                 "AWS_CONFIG_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= set(given["open"])


def test_update_endpoint_switches_to_the_new_config(sm: Any, s3: Any, runtime: Any, service: LocalSageMaker) -> None:
    put_model(s3, sm, "model-v1", "v1")
    put_model(s3, sm, "model-v2", "v2", {"FAKE_READY_DELAY": "0.5"})
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")
    old_pid = int(next(service.settings.state_dir.glob("endpoints/atelier/model-v1/opt_ml/serve.pid")).read_text())

    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="model-v2")

    updating = sm.describe_endpoint(EndpointName="atelier")
    assert (updating["EndpointStatus"], updating["EndpointConfigName"]) == ("Updating", "model-v1")
    assert invoke(runtime, "atelier", "during")[0]["model"] == "v1"  # the old one serves meanwhile
    endpoint = wait_for_endpoint(sm, "atelier", "InService")
    assert endpoint["EndpointConfigName"] == "model-v2"
    assert "FailureReason" not in endpoint
    assert invoke(runtime, "atelier", "after")[0]["model"] == "v2"
    wait_for(lambda: not pid_alive(old_pid), what="the old container to stop")


def test_failed_update_rolls_back_to_the_old_config(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    put_model(s3, sm, "broken", "never", {"FAKE_SERVE": "crash"})
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")

    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="broken")

    endpoint = wait_for(lambda: (e := sm.describe_endpoint(EndpointName="atelier"))["EndpointStatus"] != "Updating"
                        and e, what="the update to end")
    assert (endpoint["EndpointStatus"], endpoint["EndpointConfigName"]) == ("InService", "model-v1")
    assert "exited with code 3" in endpoint["FailureReason"]
    assert "cannot load the model" in endpoint["FailureReason"]
    assert invoke(runtime, "atelier", "still")[0]["model"] == "v1"


@pytest.mark.parametrize("overrides", [{"startup_timeout_seconds": 1.0}])
def test_endpoint_whose_container_never_passes_ping_fails(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "unhealthy", "x", {"FAKE_SERVE": "unhealthy"})

    sm.create_endpoint(EndpointName="sick", EndpointConfigName="unhealthy")
    endpoint = wait_for_endpoint(sm, "sick", "Failed", "InService")

    assert endpoint["EndpointStatus"] == "Failed"
    assert "did not pass the ping health check within 1 seconds" in endpoint["FailureReason"]
    assert error_of(lambda: invoke(runtime, "sick", "x")) == (
        "ValidationError", "Endpoint sick of account 123456789012 not found.")


def test_unknown_endpoint_is_validation_error(sm: Any, runtime: Any) -> None:
    assert error_of(lambda: sm.describe_endpoint(EndpointName="missing")) == (
        "ValidationException", 'Could not find endpoint "arn:aws:sagemaker:us-east-1:123456789012:endpoint/missing".')
    assert error_of(lambda: invoke(runtime, "missing", "x")) == (
        "ValidationError", "Endpoint missing of account 123456789012 not found.")
    assert error_of(lambda: sm.create_endpoint(EndpointName="e", EndpointConfigName="missing"))[0] == \
        "ValidationException"


def test_duplicate_model_config_and_endpoint_are_rejected(sm: Any, s3: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")

    assert error_of(lambda: put_model(s3, sm, "model-v1", "v1"))[1].startswith("Cannot create already existing model")
    assert error_of(lambda: sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1"))[1] == (
        'Cannot create already existing endpoint "arn:aws:sagemaker:us-east-1:123456789012:endpoint/atelier".')


def test_container_error_is_model_error(sm: Any, s3: Any, runtime: Any) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")

    with pytest.raises(ClientError) as caught:
        runtime.invoke_endpoint(EndpointName="atelier", ContentType="application/json", Body=b"{}")

    assert caught.value.response["Error"]["Code"] == "ModelError"
    assert caught.value.response["OriginalStatusCode"] == 400
    assert caught.value.response["OriginalMessage"] == "prompt is required"


def test_delete_endpoint_stops_its_container(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    wait_for_endpoint(sm, "atelier", "InService")
    pid = int((service.settings.state_dir / "endpoints/atelier/model-v1/opt_ml/serve.pid").read_text())

    sm.delete_endpoint(EndpointName="atelier")

    assert error_of(lambda: sm.describe_endpoint(EndpointName="atelier"))[0] == "ValidationException"
    wait_for(lambda: not pid_alive(pid), what="the container to stop")


# --- shutdown -----------------------------------------------------------------------------------

def test_close_stops_every_container(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")
    put_model(s3, sm, "model-v1", "v1")
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")
    sm.create_training_job(**training_request("long", hyperparameters={"sleep": "60"}))
    state = service.settings.state_dir
    wait_for_endpoint(sm, "atelier", "InService")
    wait_for(lambda: sm.describe_training_job(TrainingJobName="long")["SecondaryStatus"] == "Training",
             what="training")
    # the status says Training just before the container starts: wait until it has written its pid
    train_pid = state / "jobs/long/algo-1/opt_ml/train.pid"
    wait_for(lambda: train_pid.is_file() and train_pid.read_text().strip(), what="the training container")
    pids = [int((state / "endpoints/atelier/model-v1/opt_ml/serve.pid").read_text()), int(train_pid.read_text())]

    service.close()

    assert not any(pid_alive(pid) for pid in pids)
    assert json.loads((state / "jobs/long/job.json").read_text())["TrainingJobStatus"] == "Stopped"
