"""Provenance under moto: lineage through every stage and manifest, attribution, the CLI following an endpoint."""

from __future__ import annotations

import io
import json
import random
import tarfile
from typing import Any, Callable

import boto3
import pytest
from PIL import Image

from atelier.local.provision import Provisioned
from contracts.s3_layout import output_key
from core import aws
from core.partners import attribution
from core.provenance import lineage_of
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished
from tests.functions.provenance_helpers import (  # noqa: F401  (fixtures)
    clean,
    configure,
    manifest,
    pack,
    pictures,
    requests,
    seal,
    settings,
    small_parts,
    stack,
)


# --- lineage and attribution ----------------------------------------------------------------------

TWO_STAGES = {"training": {"run_plan": [{"name": "lo", "hyperparameters": {"resolution": "32", "steps": "3"}},
                                        {"name": "hi", "hyperparameters": {"resolution": "64", "steps": "5"}}]}}


def test_lineage_runs_through_every_stage_and_every_earlier_manifest(stack: Provisioned,
                                                                     configure: Callable[..., TrainingSettings]) -> None:
    # GIVEN two manifests of a two-stage run plan, each through both stages
    settings = configure(recipe=TWO_STAGES)
    one, two = pictures(stack, range(0, 4)), pictures(stack, range(4, 8), "partner-b")
    base_1 = seal(stack, settings, pack(stack, one[:2]), pack(stack, one[2:]))
    on_job_finished(base_1, "Completed", None, settings)
    on_job_finished(f"{base_1}-s1", "Completed", None, settings)
    base_2 = seal(stack, settings, pack(stack, two[:2]), pack(stack, two[2:]))
    on_job_finished(base_2, "Completed", None, settings)
    on_job_finished(f"{base_2}-s1", "Completed", None, settings)

    # WHEN the final model's lineage is read
    found = lineage_of(f"{base_2}-s1", settings)

    # THEN it names both manifests, their four jobs and every sample with its provenance
    assert [(m.sequence, [j.name for j in m.jobs]) for m in found.manifests] == [
        (1, [base_1, f"{base_1}-s1"]), (2, [base_2, f"{base_2}-s1"])]
    assert found.manifests[1].digest == manifest(settings, base_2).digest == found.manifest
    assert [len(m.shards) for m in found.manifests] == [2, 2]
    by_key = {s.sha256: s for s in one + two}
    assert [(s.sha256, s.partner, s.license, s.bucket, s.key, s.version_id, s.manifests) for s in found.samples] == [
        (k, by_key[k].partner, "CC-BY-4.0", by_key[k].bucket, by_key[k].key, by_key[k].version_id,
         (1,) if k in {s.sha256 for s in one} else (2,)) for k in sorted(by_key)]
    # AND lineage.json beside the model says the same; the first stage's model learned from manifest 1 only
    stored = json.loads(aws.read_object(settings.models_bucket, output_key(f"{base_2}-s1", "lineage.json")))
    assert stored == json.loads(found.model_dump_json())
    assert [m.sequence for m in lineage_of(base_1, settings).manifests] == [1]
    assert [[j.name for j in m.jobs] for m in lineage_of(base_1, settings).manifests] == [[base_1]]


def model_tar(record: dict[str, Any]) -> bytes:
    """A model.tar.gz as SageMaker makes it: weights first, then the trainer's record."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in [("unet/diffusion_pytorch_model.safetensors", random.Random(0).randbytes(200_000)),
                           ("atelier-training.json", json.dumps(record).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_attribution_counts_each_partner_s_samples_and_the_trainer_s_draws(stack: Provisioned,
                                                                         settings: TrainingSettings) -> None:
    # GIVEN a job on 6 samples of partner-a and 2 of partner-b, whose trainer drew 30 and 10
    job = seal(stack, settings, pack(stack, pictures(stack, range(0, 4))),
               pack(stack, pictures(stack, range(4, 6)) + pictures(stack, range(6, 8), "partner-b")))
    draws = {"partner-a": {"CC-BY-4.0": 30}, "partner-b": {"CC-BY-4.0": 10}}
    aws.write_object(settings.models_bucket, output_key(job, "model.tar.gz"), model_tar({"steps": 2, "draws": draws}))

    # WHEN it completes
    on_job_finished(job, "Completed", None, settings)

    # THEN attribution.json and its chart lie beside the model
    report = json.loads(aws.read_object(settings.models_bucket, output_key(job, "attribution.json")))
    assert report == {"schema_version": 1, "job": job, "samples": 8, "draws": 40,
                      "lineage_uri": f"s3://{settings.models_bucket}/{output_key(job, 'lineage.json')}",
                      "shares": [{"partner": "partner-a", "license": "CC-BY-4.0", "samples": 6, "draws": 30,
                                  "sample_share": 0.75, "draw_share": 0.75},
                                 {"partner": "partner-b", "license": "CC-BY-4.0", "samples": 2, "draws": 10,
                                  "sample_share": 0.25, "draw_share": 0.25}]}
    png = aws.read_object(settings.models_bucket, output_key(job, "attribution.png"))
    assert Image.open(io.BytesIO(png)).format == "PNG"


def test_a_model_without_the_trainer_s_counts_still_gets_its_sample_shares(stack: Provisioned, settings: TrainingSettings,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    job = seal(stack, settings, pack(stack, pictures(stack, range(0, 2))), pack(stack, pictures(stack, range(2, 4))))
    # as AWS answers the function's HEAD of a missing key: its ListBucket is limited by prefix
    real_head = aws.head_object

    def head(bucket: str, key: str) -> Any:
        if real_head(bucket, key) is None:
            raise aws.ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")
        return real_head(bucket, key)
    monkeypatch.setattr(aws, "head_object", head)

    on_job_finished(job, "Completed", None, settings)

    report = attribution.Attribution.model_validate_json(
        aws.read_object(settings.models_bucket, output_key(job, "attribution.json")))
    assert (report.samples, report.draws, [(s.samples, s.draws) for s in report.shares]) == (4, None, [(4, None)])


# --- the CLI --------------------------------------------------------------------------------------

def register_outputs(stack: Provisioned) -> None:
    """The outputs-only CloudFormation stack the local stack registers, so the CLI finds the resources."""
    template = {"Resources": {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
                "Outputs": {k: {"Value": v} for k, v in stack.outputs.items()}}
    boto3.client("cloudformation").create_stack(StackName="atelier", TemplateBody=json.dumps(template))


def deploy(stack: Provisioned, job: str, endpoint: str) -> None:
    """What the deploy function leaves: a model tagged with its training job, a config, an endpoint."""
    sagemaker = boto3.client("sagemaker")
    sagemaker.create_model(ModelName=f"{job}-model", ExecutionRoleArn=stack.outputs["SageMakerRoleArn"],
                           PrimaryContainer={"Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier:latest"},
                           Tags=[{"Key": "atelier:training-job", "Value": job}, {"Key": "atelier:manifest", "Value": "d"}])
    sagemaker.create_endpoint_config(EndpointConfigName=f"{job}-config", ProductionVariants=[{
        "VariantName": "AllTraffic", "ModelName": f"{job}-model", "InitialInstanceCount": 1,
        "InstanceType": "ml.m5.large"}])
    sagemaker.create_endpoint(EndpointName=endpoint, EndpointConfigName=f"{job}-config")


def test_the_cli_follows_an_endpoint_to_its_lineage_attribution_and_takedown_audit(
        stack: Provisioned, settings: TrainingSettings, capsys: pytest.CaptureFixture[str]) -> None:
    from atelier import cli
    register_outputs(stack)
    samples = pictures(stack, range(0, 4))
    job = seal(stack, settings, pack(stack, samples[:2]), pack(stack, samples[2:]))
    on_job_finished(job, "Completed", None, settings)
    deploy(stack, job, "atelier-endpoint")

    for model in ("atelier-endpoint", f"{job}-model", job):
        assert cli.main(["lineage", model, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["job"] == job
    assert cli.main(["attribution", "atelier-endpoint", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 4

    assert cli.main(["takedown", "--partner", "partner-a", "--sha256", samples[0].sha256, "--reason", "artist request",
                     "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["affected"], printed["models"]) == (
        [{"job": job, "status": "Completed", "stage": 0, "samples": 1}], {job: [f"{job}-model"]})
    assert cli.main(["lineage", "no-such-thing"]) == 2
