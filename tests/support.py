"""What tests share besides fixtures: paths, the local names of the stack, events from events/."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

REPO = Path(__file__).resolve().parents[1]
EVENTS = REPO / "events"
ACCOUNT, REGION, STACK = "123456789012", "us-east-1", "atelier"
# The template's image parameters have no defaults (AWS runs ECR images only); the local SageMaker
# runs trainer/ from this checkout for any image.
IMAGES = {"TrainingImageUri": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/atelier-trainer:test",
          "InferenceImageUri": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/atelier-trainer:test"}
# The tuning knobs of the tests' stacks, in every function's environment (tests/conftest.py)
TEST_ENVIRONMENT = {
    "MIN_SHORT_SIDE": "64",  # the test pictures are 96 px
    "TRAINING_FAILURE_BACKOFF_S": "0",  # a failed job's shards are retried at once unless a test sets a backoff
}
# The stack's recipe in tests: the packaged default with these changes (atelier/local/recipe.py; tests/conftest.py)
TEST_RECIPE = {"training": {
    "hyperparameters": {"steps": "2", "batch-size": "2", "resolution": "32", "model-config": "tiny"},
    "run_plan": [],  # one job a manifest; the run-plan tests set stages
}}


def load_event(name: str) -> dict[str, Any]:
    """An event from events/, by file name without `.json`."""
    return json.loads((EVENTS / f"{name}.json").read_text())


# Pillow's YCbCr (ITU-R BT.601, full range), forwards and back
_TO_YCBCR = ((0.299, 0.587, 0.114), (-0.168736, -0.331264, 0.5), (0.5, -0.418688, -0.081312))
_FROM_YCBCR = ((1.0, 0.0, 1.402), (1.0, -0.344136, -0.714136), (1.0, 1.772, 0.0))


def hue_turned(image: "Image.Image", degrees: float) -> "Image.Image":
    """The same picture with every hue turned by `degrees` at the same luminance (the chroma plane
    rotated): a recolouring the luminance dHash cannot see."""
    cos, sin = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    turn = ((1.0, 0.0, 0.0), (0.0, cos, -sin), (0.0, sin, cos))

    def times(a: tuple, b: tuple) -> tuple:
        return tuple(tuple(sum(a[i][k] * b[k][j] for k in range(3)) for j in range(3)) for i in range(3))

    matrix = times(_FROM_YCBCR, times(turn, _TO_YCBCR))
    return image.convert("RGB").convert("RGB", matrix=tuple(v for row in matrix for v in (*row, 0.0)))


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto in server mode in this process, on a free loopback port: its URL."""
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def quick_training() -> dict[str, Any]:
    """StackOptions' overrides and recipe changes: recipes/local.toml's autoencoder and training hyperparameters
    with a few steps each, for the e2e tests that need a model to flow through the chain, not one that draws its
    prompts."""
    from atelier.local.recipe import file_changes
    training = file_changes(REPO, "local")["training"]
    quick = {name: {**training[name], "steps": "20", "checkpoint-every": "10", "log-every": "10"}
             for name in ("autoencoder_hyperparameters", "hyperparameters")}
    # 16 pictures make two shards, one job
    return {"overrides": {"TrainingQuota": "2"}, "environment": {"SHARD_MAX_SAMPLES": "8"}, "recipe": {"training": quick}}


def denied(call: Any, **kwargs: Any) -> bool:
    """Whether AWS refuses the call as AccessDenied (any other error fails the test)."""
    from botocore.exceptions import ClientError
    try:
        call(**kwargs)
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "AccessDenied", exc
        return True
    return False


def sagemaker_job(name: str, output_uri: str, tags: dict[str, str]) -> None:
    """A training job as SageMaker knows it, with the tags the pipeline gave it: moto completes it at once,
    its artefact at `<output_uri><name>/output/model.tar.gz`."""
    import boto3
    boto3.client("sagemaker").create_training_job(
        TrainingJobName=name, RoleArn=f"arn:aws:iam::{ACCOUNT}:role/atelier-sagemaker",
        AlgorithmSpecification={"TrainingImage": IMAGES["TrainingImageUri"], "TrainingInputMode": "FastFile"},
        OutputDataConfig={"S3OutputPath": output_uri},
        ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
        StoppingCondition={"MaxRuntimeInSeconds": 60}, Tags=[{"Key": k, "Value": v} for k, v in tags.items()])


def read_c2pa(png: bytes, anchors: str) -> tuple[str, dict, list[str]] | None:
    """(validation state, active manifest, failure codes) of a PNG's C2PA manifest, trusting only
    `anchors` (PEM root certificates); None without a manifest."""
    import io

    import c2pa
    settings = {"trust": {"user_anchors": anchors}, "verify": {"remote_manifest_fetch": False}}
    with c2pa.Context.from_dict(settings) as context:
        reader = c2pa.Reader.try_create("image/png", io.BytesIO(png), context=context)
        if reader is None:
            return None
        with reader:
            store = json.loads(reader.json())
            failures = reader.get_validation_results()["activeManifest"].get("failure", [])
            return (reader.get_validation_state(), store["manifests"][store["active_manifest"]],
                    [failure["code"] for failure in failures])


def c2pa_assertions(manifest: dict) -> dict[str, dict]:
    """A C2PA manifest's assertions by label."""
    return {assertion["label"]: assertion["data"] for assertion in manifest["assertions"]}
