"""The local SageMaker on several instances: channel shares, lost instances retried, instance types, the trainer."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atelier.local.sagemaker import LocalSageMaker
from atelier.local.sagemaker.training_instances import host_names
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    aws,
    complete_checkpoint_in_s3,
    error_of,
    job_events,
    moto_url,
    overrides,
    put_model,
    put_shards,
    read_tar,
    s3,
    s3_text,
    service,
    sm,
    tiny_shard,
    trainer_events,
    training_request,
    wait_for,
    wait_for_job,
)

pytestmark = pytest.mark.slow(seconds=45)


# --- several instances, checkpoints and retries --------------------------------------------------

def two_instances(request: dict[str, Any]) -> dict[str, Any]:
    request["ResourceConfig"]["InstanceCount"] = 2
    return request


def host_files(s3: Any, job: dict[str, Any], host: str) -> dict[str, Any]:
    """What the fake container on `host` saw: model/hosts/<host>.json in the job's model archive."""
    return json.loads(read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])[f"hosts/{host}.json"])


def secondary_statuses(job: dict[str, Any]) -> list[str]:
    return [t["Status"] for t in job["SecondaryStatusTransitions"]]


def test_each_instance_gets_its_share_of_a_sharded_channel_and_all_of_a_replicated_one(
        sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/e.tar", "shards/a.tar", "shards/d.tar", "shards/b.tar", "shards/c.tar", "eval/x.tar")
    request = two_instances(training_request("two-hosts"))
    request["InputDataConfig"].append({"ChannelName": "eval", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": "s3://data/eval/", "S3DataDistributionType": "FullyReplicated"}}})

    sm.create_training_job(**request)
    job = wait_for_job(sm, "two-hosts", "Completed", "Failed")

    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    first, second = host_files(s3, job, "algo-1"), host_files(s3, job, "algo-2")
    # ShardedByS3Key: the key-sorted objects dealt round-robin, disjoint shares whose union is the channel
    assert first["channels"]["train"] == ["a.tar", "c.tar", "e.tar"]
    assert second["channels"]["train"] == ["b.tar", "d.tar"]
    # FullyReplicated: every instance has every object
    assert first["channels"]["eval"] == second["channels"]["eval"] == ["x.tar"]
    assert (first["current_host"], second["current_host"]) == ("algo-1", "algo-2")
    assert first["hosts"] == second["hosts"] == ["algo-1", "algo-2"]
    # one model archive gathers every instance's model/
    assert sorted(read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])) == [
        "files.json", "hosts", "hosts/algo-1.json", "hosts/algo-2.json", "sub", "sub/weights.bin"]
    config = service.settings.state_dir / "jobs/two-hosts/algo-2/opt_ml/input/config/resourceconfig.json"
    assert json.loads(config.read_text())["current_host"] == "algo-2"


def test_hosts_are_listed_sorted_as_sagemaker_lists_them() -> None:
    assert host_names(11)[:4] == ["algo-1", "algo-10", "algo-11", "algo-2"]


def test_a_lost_instance_is_retried_from_the_restored_checkpoint(
        sm: Any, s3: Any, service: LocalSageMaker, job_events: Callable) -> None:
    put_shards(s3, "shards/a.tar", "shards/b.tar")
    # GIVEN a two-instance job that lingers after its first checkpoint, unless it resumed from one
    sm.create_training_job(**two_instances(training_request(
        "lossy", hyperparameters={"sleep-unless-resumed": "30"},
        CheckpointConfig={"S3Uri": "s3://models/checkpoints/lossy/"})))
    wait_for(lambda: s3.list_objects_v2(Bucket="models", Prefix="checkpoints/lossy/latest").get("KeyCount"),
             what="the first checkpoint in S3")

    # WHEN one of its instances goes away
    service.lose_training_instance("lossy", "algo-2")
    job = wait_for_job(sm, "lossy", "Completed", "Failed")

    # THEN a second attempt on new instances restored the checkpoint into each and completed
    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    assert host_files(s3, job, "algo-1")["resumed_from"] == host_files(s3, job, "algo-2")["resumed_from"] == "1"
    assert s3_text(s3, "models", "checkpoints/lossy/latest") == "2"
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training",
                                       "Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert job["SecondaryStatusTransitions"][3]["StatusMessage"] == (
        "Restarting the training job after an internal error: attempt 2 of 3 on new instances")
    statuses = [(e["detail"]["TrainingJobStatus"], e["detail"]["SecondaryStatus"])
                for e in job_events("lossy", "Completed")]
    assert statuses == [("InProgress", s) for s in secondary_statuses(job)[:-1]] + [("Completed", "Completed")]
    log = (service.settings.state_dir / "jobs/lossy/algo-2/logs.txt").read_text()
    assert "--- lossy attempt 1 of 3 on algo-2 ---" in log and "--- lossy attempt 2 of 3 on algo-2 ---" in log


def test_a_loss_on_a_condition_is_taken_also_when_the_containers_ended_first(
        sm: Any, s3: Any, service: LocalSageMaker) -> None:
    put_shards(s3, "shards/a.tar")
    # GIVEN a job whose container writes its first checkpoint and ends at once
    sm.create_training_job(**training_request(
        "quick", CheckpointConfig={"S3Uri": "s3://models/checkpoints/quick/"}))

    # WHEN its instance is to be lost once that checkpoint's marker is in S3
    service.lose_training_instance("quick", once=lambda: s3.list_objects_v2(
        Bucket="models", Prefix="checkpoints/quick/latest").get("KeyCount"))
    job = wait_for_job(sm, "quick", "Completed", "Failed")

    # THEN the attempt counted as lost, whenever its container ended, and the retry resumed from it
    assert job["TrainingJobStatus"] == "Completed", job.get("FailureReason")
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training",
                                       "Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert host_files(s3, job, "algo-1")["resumed_from"] == "1"
    assert s3_text(s3, "models", "checkpoints/quick/latest") == "2"


@pytest.mark.parametrize("retry_strategy, losses", [(None, 1), ({"MaximumRetryAttempts": 1}, 2)])
def test_losing_an_instance_on_the_last_attempt_fails_as_an_internal_error(
        sm: Any, s3: Any, service: LocalSageMaker, retry_strategy: dict | None, losses: int) -> None:
    put_shards(s3, "shards/a.tar")
    request = training_request("doomed", hyperparameters={"sleep": "30"})
    request.pop("RetryStrategy")
    if retry_strategy:
        request["RetryStrategy"] = retry_strategy
    sm.create_training_job(**request)

    for attempt in range(1, losses + 1):
        wait_for(lambda: secondary_statuses(sm.describe_training_job(TrainingJobName="doomed")).count("Training")
                 == attempt, what=f"attempt {attempt} to train")
        service.lose_training_instance("doomed")
    job = wait_for_job(sm, "doomed", "Completed", "Failed")

    assert (job["TrainingJobStatus"], job["SecondaryStatus"]) == ("Failed", "Failed")
    assert job["FailureReason"] == ("InternalServerError: We encountered an internal error. Please try again. "
                                    f"(local runner: instance algo-1 was lost during attempt {losses} of {losses})")
    assert secondary_statuses(job).count("Training") == losses


def test_a_failing_script_is_not_retried(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar", "shards/b.tar")

    sm.create_training_job(**two_instances(training_request("broken", hyperparameters={"fail": "CUDA out of memory"})))
    job = wait_for_job(sm, "broken", "Completed", "Failed")

    assert (job["TrainingJobStatus"], job["FailureReason"]) == ("Failed", "CUDA out of memory")
    assert secondary_statuses(job) == ["Starting", "Downloading", "Training", "Failed"]


@pytest.mark.parametrize("instance_type", ["ml.p4d.24xlarge", "ml.g5.xlarge", "ml.p5.48xlarge"])
def test_a_volume_key_on_an_instance_store_type_is_refused_as_aws_refuses_it(sm: Any, instance_type: str) -> None:
    resources = {"InstanceType": instance_type, "InstanceCount": 1, "VolumeSizeInGB": 50, "VolumeKmsKeyId": "k"}

    code, message = error_of(lambda: sm.create_training_job(**training_request("keyed", ResourceConfig=resources)))

    assert code == "ValidationException" and instance_type in message


def test_a_volume_key_on_an_ebs_type_is_accepted(sm: Any) -> None:
    resources = {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50, "VolumeKmsKeyId": "k"}

    sm.create_training_job(**training_request("keyed-ebs", ResourceConfig=resources))

    assert sm.describe_training_job(TrainingJobName="keyed-ebs")["ResourceConfig"]["VolumeKmsKeyId"] == "k"


def test_an_endpoint_config_key_on_an_instance_store_type_is_refused(sm: Any, s3: Any) -> None:
    put_model(s3, sm, "kms-model", "ok")
    variant = {"VariantName": "AllTraffic", "ModelName": "kms-model", "InitialInstanceCount": 1}

    code, message = error_of(lambda: sm.create_endpoint_config(
        EndpointConfigName="kms-g5", KmsKeyId="k", ProductionVariants=[{**variant, "InstanceType": "ml.g5.xlarge"}]))
    sm.create_endpoint_config(EndpointConfigName="kms-m5", KmsKeyId="k",
                              ProductionVariants=[{**variant, "InstanceType": "ml.m5.large"}])

    assert code == "ValidationException" and "ml.g5.xlarge" in message


def test_a_variant_startup_timeout_outside_aws_range_is_refused(sm: Any, s3: Any) -> None:
    """API_ProductionVariant: ContainerStartupHealthCheckTimeoutInSeconds lies in 60..3600 (botocore checks
    the minimum before sending; the maximum is the service's to refuse)."""
    put_model(s3, sm, "slow-start", "ok")
    variant = {"VariantName": "AllTraffic", "ModelName": "slow-start", "InitialInstanceCount": 1, "InstanceType": "ml.m5.large"}

    code, message = error_of(lambda: sm.create_endpoint_config(
        EndpointConfigName="too-long", ProductionVariants=[{**variant, "ContainerStartupHealthCheckTimeoutInSeconds": 3601}]))
    sm.create_endpoint_config(EndpointConfigName="in-range",
                              ProductionVariants=[{**variant, "ContainerStartupHealthCheckTimeoutInSeconds": 1200}])

    assert code == "ValidationException" and "containerStartupHealthCheckTimeoutInSeconds" in message and "3600" in message
    assert sm.describe_endpoint_config(EndpointConfigName="in-range")["ProductionVariants"][0][
        "ContainerStartupHealthCheckTimeoutInSeconds"] == 1200


@pytest.mark.parametrize("member, value", [("ResourceConfig", {"InstanceType": "ml.g5.xlarge", "InstanceCount": 0}),
                                           ("RetryStrategy", {"MaximumRetryAttempts": 31})])
def test_instance_count_and_retry_attempts_are_range_checked(sm: Any, member: str, value: dict) -> None:
    code, message = error_of(lambda: sm.create_training_job(**training_request("bad-range", **{member: value})))

    assert code == "ValidationException"
    assert "failed to satisfy constraint: Member must have value" in message


# --- the real trainer ---------------------------------------------------------------------------

TRAINER_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier-trainer:latest"  # unmapped: trainer.container


def lineage_tokenizer(s3: Any, shards: list[bytes]) -> str:
    """The tokenizer job's folders for these shards, under an S3 prefix (the `tokenizer` channel)."""
    from trainer.jobs import tokenizer as tokenizer_job
    with tempfile.TemporaryDirectory() as work:
        for number, shard in enumerate(shards):
            (Path(work) / "shards").mkdir(exist_ok=True)
            (Path(work) / "shards" / f"s-{number}.tar").write_bytes(shard)
        tokenizer_job.main(tokenizer_job.parse_args(["--train-dir", f"{work}/shards", "--model-dir", f"{work}/model",
                                                     "--model-config", "tiny"]))
        for path in sorted((Path(work) / "model").rglob("*")):
            if path.is_file() and "health" not in path.relative_to(Path(work) / "model").parts:
                s3.put_object(Bucket="data", Key=f"tokenizers/e2e/{path.relative_to(Path(work) / 'model')}",
                              Body=path.read_bytes())
    return "s3://data/tokenizers/e2e/"


@pytest.mark.e2e
@pytest.mark.parametrize("overrides", [{"checkpoint_sync_seconds": 0.2, "stop_grace_seconds": 5}])
def test_the_trainer_on_two_instances_resumes_after_losing_one(sm: Any, s3: Any, service: LocalSageMaker) -> None:
    # GIVEN two shards, one per instance, and a 4-step job on two instances checkpointing every step and
    # keeping every checkpoint (none is pruned before the sync uploads it)
    s3.put_object(Bucket="data", Key="shards/s-0.tar", Body=tiny_shard(0, 4))
    s3.put_object(Bucket="data", Key="shards/s-1.tar", Body=tiny_shard(4, 4))
    request = two_instances(training_request(
        "trainer-e2e", CheckpointConfig={"S3Uri": "s3://models/checkpoints/e2e/"},
        StoppingCondition={"MaxRuntimeInSeconds": 600}))
    request["AlgorithmSpecification"]["TrainingImage"] = TRAINER_IMAGE
    # the lineage's tokenizer, as its tokenizer job leaves it: each host sees only its own shards' captions
    request["InputDataConfig"].append({**request["InputDataConfig"][0], "ChannelName": "tokenizer", "DataSource": {
        "S3DataSource": {**request["InputDataConfig"][0]["DataSource"]["S3DataSource"],
                         "S3Uri": lineage_tokenizer(s3, [tiny_shard(0, 4), tiny_shard(4, 4)]),
                         "S3DataDistributionType": "FullyReplicated"}}})
    request["HyperParameters"] = {"steps": "4", "batch-size": "2", "resolution": "32", "checkpoint-every": "1",
                                  "keep-checkpoints": "4", "seed": "0", "model-config": "tiny", "num-workers": "0",
                                  "log-every": "1", "validation-prompts": "", "tokenizer": "tokenizer"}
    sm.create_training_job(**request)

    # WHEN the leader's instance is lost once a whole checkpoint has reached S3 (each instance uploads its
    # own files: `latest` can be there before the step directory it names, which would not verify). The
    # condition is tested after each upload and nothing of the attempt reaches S3 after it holds, so the
    # loss comes before the attempt's end however fast its steps run.
    service.lose_training_instance("trainer-e2e", "algo-1",
                                   once=lambda: complete_checkpoint_in_s3(s3, "models", "checkpoints/e2e/"))
    job = wait_for(lambda: (j := sm.describe_training_job(TrainingJobName="trainer-e2e"))["TrainingJobStatus"]
                   in ("Completed", "Failed", "Stopped") and j, timeout=180, what="the job to end")

    # THEN the second attempt resumed from the checkpoint under torchrun on both hosts and completed
    assert job["TrainingJobStatus"] == "Completed", (job.get("FailureReason"), service.training_log_tail("trainer-e2e"))
    assert secondary_statuses(job).count("Training") == 2
    events = trainer_events(service.settings.state_dir / "jobs/trainer-e2e/algo-1/logs.txt")
    resumed = [e for e in events if e.get("event") == "resumed"]
    assert len(resumed) == 1 and 1 <= resumed[0]["step"] < 4, [e for e in events if e.get("event")]
    starts = [e for e in events if e.get("event") == "start"]
    assert [(e["step"], e["world_size"], e["backend"]) for e in starts] == [
        (0, 2, "gloo"), (resumed[0]["step"], 2, "gloo")]
    archive = read_tar(s3, job["ModelArtifacts"]["S3ModelArtifacts"])
    assert "model_index.json" in archive
    assert json.loads(archive["atelier-training.json"])["steps"] == 4
