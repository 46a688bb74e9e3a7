"""A run plan's stages through the local SageMaker: StartTrainingFunction's core (its resources from
template.yaml, on moto in server mode) starts each stage's job, the real trainer (trainer.container) runs
it, and the next stage's job resumes the lineage's checkpoints, as on AWS.
"""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest

from atelier.local.provision import Provisioner
from atelier.local.sagemaker import LocalSageMaker
from contracts.messages import ShardSealed
from core import aws as core_aws
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished, on_shard_sealed
from tests.conftest import expanded_template
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    aws,
    moto_url,
    service,
    sm,
    tiny_shard,
    trainer_events,
    wait_for,
)
from tests.support import ACCOUNT, REGION, STACK

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=150)]
# Each stage warms up over its first 2 steps to its own rate.
TWO_STAGES = [{"name": "lo", "hyperparameters": {"steps": "2", "learning-rate": "0.001", "lr-warmup-steps": "2"}},
              {"name": "hi", "hyperparameters": {"steps": "3", "learning-rate": "0.0005", "lr-warmup-steps": "2"}}]
HYPERPARAMETERS = {"model-config": "tiny", "resolution": "32", "batch-size": "2", "seed": "0", "num-workers": "0",
                   "log-every": "1", "validation-prompts": "", "aspect-buckets": "false", "cpu-threads": "1"}


@pytest.fixture
def overrides() -> dict[str, Any]:
    """test_sagemaker's settings as they are (its `service` fixture reads this)."""
    return {}


@pytest.fixture
def settings(service: LocalSageMaker, monkeypatch: pytest.MonkeyPatch) -> TrainingSettings:
    """The template's resources on the moto server, and StartTrainingFunction's settings with the plan above,
    one shard a job and jobs that run the trainer."""
    provisioned = Provisioner(expanded_template(), STACK, REGION, ACCOUNT, boto3.client).provision()
    core_aws.reset_clients()  # core's clients go to the moto server and the local SageMaker too
    environment = {**provisioned.functions["StartTrainingFunction"].environment,
                   "TRAINING_QUOTA": "1", "TRAINING_REPLAY_SHARE": "0", "TRAINING_MAX_RUNTIME_S": "600",
                   "TRAINING_HYPERPARAMETERS": json.dumps(HYPERPARAMETERS), "TRAINING_RUN_PLAN": json.dumps(TWO_STAGES)}
    return TrainingSettings.from_env(environment)


def run_to_the_end(sm: Any, name: str, service: LocalSageMaker) -> list[dict[str, Any]]:
    """Wait for the job to complete; its trainer's (rank 0's) log lines."""
    job = wait_for(lambda: (j := sm.describe_training_job(TrainingJobName=name))["TrainingJobStatus"]
                   in ("Completed", "Failed", "Stopped") and j, timeout=300, what=f"{name} to end")
    assert job["TrainingJobStatus"] == "Completed", (job.get("FailureReason"), service.training_log_tail(name))
    return trainer_events(service.settings.state_dir / f"jobs/{name}/algo-1/logs.txt")


def rates(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(event["step"], event["lr"]) for event in events if "lr" in event]


def test_the_second_stage_s_job_warms_up_from_its_own_first_step(sm: Any, settings: TrainingSettings,
                                                                  service: LocalSageMaker) -> None:
    # GIVEN a sealed shard: the quota, so the first stage's job starts
    s3 = boto3.client("s3", region_name=REGION)
    s3.put_object(Bucket=settings.data_bucket, Key="shards/shard-1.tar", Body=tiny_shard(0, 4))
    first = on_shard_sealed(ShardSealed(
        shard_id="shard-1", bucket=settings.data_bucket, key="shards/shard-1.tar", sha256="1" * 64, size=1,
        samples=4, partners=["partner-a"], sealed_at="2026-12-05T12:00:00+00:00"), settings).job_name
    assert first is not None
    first_events = run_to_the_end(sm, first, service)

    # WHEN it completes, the second stage's job starts and resumes the lineage's checkpoint of step 2
    on_job_finished(first, "Completed", None, settings)
    second_events = run_to_the_end(sm, f"{first}-s1", service)

    # THEN each job warmed up from its own first step to its own stage's rate
    assert rates(first_events) == [(1, 0.0005), (2, 0.001)]
    assert [e["step"] for e in second_events if e.get("event") == "resumed"] == [2]
    assert rates(second_events) == [(3, 0.00025), (4, 0.0005), (5, 0.0005)]
