"""trainer/launch.py sends the pipeline's own request through the SageMaker Python SDK's session."""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import boto3
import pytest

from contracts.messages import Manifest, ShardRef
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import training_job_request
from trainer import launch


class FakeSession:
    """What launch.py uses of sagemaker.Session: boto_session, sagemaker_client, logs_for_job."""

    def __init__(self) -> None:
        self.boto_session = boto3.session.Session()
        self.created: list[dict[str, Any]] = []
        self.waited: list[str] = []
        self.sagemaker_client = types.SimpleNamespace(create_training_job=lambda **r: self.created.append(r))

    def logs_for_job(self, name: str, wait: bool) -> None:
        self.waited.append(name)


def test_launch_sends_exactly_the_pipelines_request(stack, function_env, tmp_path, monkeypatch) -> None:
    # GIVEN the StartTrainingFunction's environment in a file and a manifest the pipeline wrote
    env = function_env("StartTrainingFunction")
    (tmp_path / "env.json").write_text(json.dumps(env))
    data = stack.outputs["DataBucketName"]
    manifest = Manifest(bucket=data, prefix="shards/", lineage="main", sequence=1, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="1" * 64, samples=8),))
    boto3.client("s3").put_object(Bucket=data, Key="manifests/atelier-x.json", Body=manifest.model_dump_json())
    session = FakeSession()
    monkeypatch.setitem(sys.modules, "sagemaker", types.SimpleNamespace(Session=lambda: session))
    # WHEN a person launches it by hand
    args = launch.parse_args(["--manifest", f"s3://{data}/manifests/atelier-x.manifest", "--job-name", "manual-1",
                              "--env-json", str(tmp_path / "env.json"), "--wait"])
    sent = launch.launch(args)
    # THEN the SDK session created the pipeline's request for that manifest, and streamed its logs
    settings = TrainingSettings.current(env)
    expected = training_job_request("manual-1", f"s3://{data}/manifests/atelier-x.manifest", manifest.digest, 0,
                                    settings.run_plan[0].steps, settings)
    assert session.created == [expected] == [sent]
    assert session.waited == ["manual-1"]


def test_a_manual_launch_carries_the_manifest_s_exclusion_list(stack, function_env, tmp_path, monkeypatch) -> None:
    # GIVEN a manifest that excludes a revoked sample
    env = function_env("StartTrainingFunction")
    (tmp_path / "env.json").write_text(json.dumps(env))
    data = stack.outputs["DataBucketName"]
    manifest = Manifest(bucket=data, prefix="shards/", lineage="main", sequence=1, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="1" * 64, samples=8),),
        exclude={"shard-1": ("a" * 64,)})
    boto3.client("s3").put_object(Bucket=data, Key="manifests/atelier-y.json", Body=manifest.model_dump_json())
    session = FakeSession()
    monkeypatch.setitem(sys.modules, "sagemaker", types.SimpleNamespace(Session=lambda: session))
    # WHEN it is launched by hand
    sent = launch.launch(launch.parse_args(["--manifest", f"s3://{data}/manifests/atelier-y.manifest",
                                            "--job-name", "manual-2", "--env-json", str(tmp_path / "env.json")]))
    # THEN the trainer gets the exclusion list as the pipeline's job would
    channels = {c["ChannelName"]: c for c in sent["InputDataConfig"]}
    assert channels["manifest"]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{data}/manifests/atelier-y.json"


def test_a_manual_launch_reads_the_lineage_s_own_vae_as_the_pipeline_s_job_would(stack, function_env, tmp_path,
                                                                                    monkeypatch) -> None:
    env = function_env("StartTrainingFunction")
    (tmp_path / "env.json").write_text(json.dumps(env))
    settings = TrainingSettings.current(env)
    data, vae = stack.outputs["DataBucketName"], f"s3://{stack.outputs['ModelsBucketName']}/training/ae/output/model.tar.gz"
    manifest = Manifest(bucket=data, prefix="shards/", lineage="main", sequence=1, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="1" * 64, samples=8),))
    boto3.client("s3").put_object(Bucket=data, Key="manifests/atelier-z.json", Body=manifest.model_dump_json())
    boto3.client("dynamodb").put_item(TableName=settings.table, Item={"pk": {"S": f"LINEAGE#{settings.lineage}"},
                                                                      "vae_uri": {"S": vae}})
    session = FakeSession()
    monkeypatch.setitem(sys.modules, "sagemaker", types.SimpleNamespace(Session=lambda: session))
    argv = ["--manifest", f"s3://{data}/manifests/atelier-z.manifest", "--env-json", str(tmp_path / "env.json")]

    sent = launch.launch(launch.parse_args([*argv, "--job-name", "manual-3"]))
    assert sent == training_job_request("manual-3", f"s3://{data}/manifests/atelier-z.manifest", manifest.digest, 0,
                                        settings.run_plan[0].steps, settings, vae_uri=vae)
    assert vae in {c["DataSource"]["S3DataSource"]["S3Uri"] for c in sent["InputDataConfig"]}
    without = launch.launch(launch.parse_args([*argv, "--job-name", "manual-4", "--vae-uri", ""]))
    assert vae not in json.dumps(without)


def test_a_manual_launch_up_to_a_later_step_warms_up_from_its_stage_s_first_step(stack, function_env) -> None:
    settings = TrainingSettings.current(function_env("StartTrainingFunction"))  # one stage of 2 steps (TEST_RECIPE)
    manifest = Manifest(bucket="data", prefix="shards/", lineage="main", sequence=2, shards=(
        ShardRef(shard_id="shard-1", key="shards/shard-1.tar", sha256="1" * 64, samples=8),))
    args = launch.parse_args(["--manifest", "s3://data/manifests/m.manifest", "--job-name", "manual-5",
                              "--env-json", "env.json", "--steps", "10", "--vae-uri", ""])

    hyperparameters = launch.build_request(args, settings, manifest)["HyperParameters"]

    assert (hyperparameters["steps"], hyperparameters["first-step"]) == ("10", "9")


def test_launch_needs_a_source_for_the_pipelines_settings() -> None:
    with pytest.raises(SystemExit):
        launch.parse_args(["--manifest", "s3://b/m.manifest", "--job-name", "x"])
