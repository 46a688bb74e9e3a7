"""core.start_training.starter, the pure half: choosing shards (new and replay), naming jobs, the job request.

The orchestration against moto (claims, the lineage lock and queue, job ends, stages) is in
tests/functions/test_training_jobs.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import boto3
import pytest
from botocore.validate import validate_parameters

from contracts.messages import Manifest, ShardRef, ShardSealed
from contracts.metrics import METRIC_DEFINITIONS
from core.start_training.run_plan import PlannedJob
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import planned_job_hyperparameters, training_job_request
from core.start_training.manifests import job_name_for, manifest_file, manifest_from, replay_shards

DATA = "atelier-data-123456789012-us-east-1"
MODELS = "atelier-models-123456789012-us-east-1"
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's TrainingJobName pattern
MANIFEST_URI = f"s3://{DATA}/manifests/atelier-0123456789abcdef0123.manifest"
BASE_HPS = {"steps": "100", "batch-size": "32", "resolution": "256", "seed": "0"}


def shard(n: int, sealed_at: str | None = None) -> ShardSealed:
    shard_id = f"shard-{n:032x}"
    return ShardSealed(shard_id=shard_id, bucket=DATA, key=f"shards/{shard_id}.tar", sha256=f"{n:064x}",
                       size=10240 * n, samples=n, partners=["partner-a"],
                       sealed_at=sealed_at or f"2026-11-29T12:{n:02d}:00+00:00")


def ref(n: int, sealed_at: str | None = None, role: str = "new") -> ShardRef:
    s = shard(n, sealed_at)
    return ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples, partners=("partner-a",),
                    role=role)


def manifest_of(*refs: ShardRef, sequence: int = 1, lineage: str = "main") -> Manifest:
    return Manifest(bucket=DATA, prefix="shards/", shards=tuple(refs), lineage=lineage, sequence=sequence)


SETTINGS = TrainingSettings(
    table="atelier-PipelineTable", data_bucket=DATA, models_bucket=MODELS, quota=2,
    role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
    volume_gb=200, max_runtime_s=432000, max_retries=3, lineage="main", concurrency="queue", replay_share=0.0,
    keep_alive_s=0, subnets=(), security_groups=(), kms_key="",
    run_plan=(PlannedJob("main", "ml.p5.48xlarge", 2, BASE_HPS),), use="commercial",
    max_consecutive_failures=3, failure_backoff_s=600, gpus_per_instance=0,
)
# A BRIA-like run plan: 256 px on 4 instances, then 512 px on 8, each with its own steps.
TWO_STAGES = dataclasses.replace(SETTINGS, run_plan=(
    PlannedJob("256", "ml.p5.48xlarge", 4, {**BASE_HPS, "steps": "50000"}),
    PlannedJob("512", "ml.p4d.24xlarge", 8, {**BASE_HPS, "steps": "30000", "resolution": "512"}),
))


def with_replay(share: float) -> TrainingSettings:
    return dataclasses.replace(SETTINGS, replay_share=share)


# --- manifest_from: which new shards -----------------------------------------------------------

def test_manifest_from_is_none_below_the_quota() -> None:
    assert manifest_from([shard(1)], [ref(9)], SETTINGS, sequence=1) is None


def test_manifest_from_is_none_without_shards() -> None:
    assert manifest_from([], [], SETTINGS, sequence=1) is None


def test_manifest_from_at_the_quota_takes_every_shard() -> None:
    assert manifest_from([shard(2), shard(1)], [], SETTINGS, sequence=1) == manifest_of(ref(1), ref(2))


def test_manifest_from_takes_the_oldest_quota_shards_by_sealed_at() -> None:
    pending = [shard(5), shard(1), shard(4), shard(2), shard(3)]

    assert manifest_from(pending, [], dataclasses.replace(SETTINGS, quota=3), sequence=1) \
        == manifest_of(ref(1), ref(2), ref(3))


def test_manifest_from_breaks_sealed_at_ties_by_shard_id() -> None:
    same_time, earlier = "2026-11-29T12:00:00+00:00", "2026-11-29T11:00:00+00:00"
    pending = [shard(3, same_time), shard(9, earlier), shard(1, same_time), shard(2, same_time)]

    assert manifest_from(pending, [], dataclasses.replace(SETTINGS, quota=3), sequence=1) == manifest_of(
        ref(9, earlier), ref(1, same_time), ref(2, same_time))


def test_manifest_records_the_lineage_and_its_sequence() -> None:
    manifest = manifest_from([shard(1), shard(2)], [], dataclasses.replace(SETTINGS, lineage="faces"), sequence=7)

    assert (manifest.lineage, manifest.sequence, manifest.bucket, manifest.prefix) == ("faces", 7, DATA, "shards/")


def test_manifest_shards_carry_sha256_samples_and_partners() -> None:
    manifest = manifest_from([shard(1), shard(2)], [], SETTINGS, sequence=1)

    assert [(s.sha256, s.samples, s.partners, s.role, s.weight) for s in manifest.shards] == [
        (f"{1:064x}", 1, ("partner-a",), "new", 1.0), (f"{2:064x}", 2, ("partner-a",), "new", 1.0)]


# --- replay ---------------------------------------------------------------------------------------

TRAINED = [ref(n) for n in range(101, 111)]  # ten shards trained by earlier jobs
NEW = [shard(n) for n in range(1, 5)]


def replayed(manifest: Manifest) -> list[str]:
    return [s.shard_id for s in manifest.shards if s.role == "replay"]


def test_replay_share_zero_adds_no_earlier_shard() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.0), quota=4), sequence=2)

    assert manifest.shards == tuple(ref(n) for n in range(1, 5))


def test_replay_half_of_four_new_shards_adds_exactly_four_trained_shards() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.5), quota=4), sequence=2)

    trained_ids = {s.shard_id for s in TRAINED}
    assert [s.shard_id for s in manifest.new_shards] == [shard(n).shard_id for n in range(1, 5)]
    assert len(replayed(manifest)) == 4
    assert set(replayed(manifest)) <= trained_ids
    assert len(set(replayed(manifest))) == 4
    assert [(s.role, s.weight) for s in manifest.shards[4:]] == [("replay", 1.0)] * 4
    assert replayed(manifest) == sorted(replayed(manifest))


def test_replay_shards_keep_their_sha256_and_samples() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.5), quota=4), sequence=2)

    by_id = {s.shard_id: s for s in TRAINED}
    assert [s.model_copy(update={"role": "new"}) for s in manifest.shards[4:]] \
        == [by_id[i] for i in replayed(manifest)]


def test_replay_is_deterministic_for_the_same_new_shards() -> None:
    settings = dataclasses.replace(with_replay(0.5), quota=4)

    first = manifest_from(NEW, TRAINED, settings, sequence=2)
    again = manifest_from(list(reversed(NEW)), list(reversed(TRAINED)), settings, sequence=2)

    assert replayed(first) == replayed(again)
    assert first.digest == again.digest


def test_replay_differs_for_different_new_shards() -> None:
    settings = dataclasses.replace(with_replay(0.5), quota=4)
    other_new = [shard(n) for n in range(5, 9)]

    assert replayed(manifest_from(NEW, TRAINED, settings, sequence=2)) \
        != replayed(manifest_from(other_new, TRAINED, settings, sequence=2))


def test_replay_never_takes_more_than_the_trained_shards() -> None:
    # 0.9 of the mix would want 36 earlier shards for 4 new ones; only 3 exist
    manifest = manifest_from(NEW, TRAINED[:3], dataclasses.replace(with_replay(0.9), quota=4), sequence=2)

    assert replayed(manifest) == [s.shard_id for s in TRAINED[:3]]


def test_replay_without_trained_shards_is_empty() -> None:
    assert replay_shards([ref(1), ref(2)], [], 0.5) == []


@pytest.mark.parametrize(("new", "share", "wanted"), [
    (4, 0.5, 4), (8, 0.2, 2), (4, 0.2, 1), (3, 0.25, 1), (8, 0.0, 0),
])
def test_replay_count_makes_up_the_share_of_the_mix(new: int, share: float, wanted: int) -> None:
    assert len(replay_shards([ref(n) for n in range(1, new + 1)], TRAINED, share)) == wanted


# --- digests and names ----------------------------------------------------------------------------

def test_job_name_is_a_valid_sagemaker_name() -> None:
    name = job_name_for(manifest_of(ref(1), ref(2)))

    assert len(name) <= 63 and JOB_NAME.match(name)


def test_job_name_is_atelier_and_20_hex_of_the_manifest_digest() -> None:
    manifest = manifest_of(ref(1), ref(2))

    assert job_name_for(manifest) == f"atelier-{manifest.digest[:20]}"


def test_stage_job_names_add_the_stage_index_after_the_first() -> None:
    manifest = manifest_of(ref(1), ref(2))

    assert [job_name_for(manifest, k) for k in (0, 1, 2)] == [
        f"atelier-{manifest.digest[:20]}", f"atelier-{manifest.digest[:20]}-s1", f"atelier-{manifest.digest[:20]}-s2"]
    assert all(JOB_NAME.match(job_name_for(manifest, k)) for k in (1, 29))


def test_job_name_is_stable_for_the_same_manifest() -> None:
    assert job_name_for(manifest_of(ref(1), ref(2))) == job_name_for(manifest_of(ref(1), ref(2)))


def test_job_name_differs_for_different_shards() -> None:
    assert job_name_for(manifest_of(ref(1), ref(2))) != job_name_for(manifest_of(ref(1), ref(3)))


def test_same_shards_at_the_next_sequence_name_a_new_job() -> None:
    # GIVEN the shards of a job that failed, claimed again as the lineage's next manifest
    pending = [shard(1), shard(2)]
    failed = manifest_from(pending, [], SETTINGS, sequence=1)
    retried = manifest_from(pending, [], SETTINGS, sequence=2)

    # THEN the digest and so the job name differ, though the shards are the same
    assert failed.shards == retried.shards
    assert failed.digest != retried.digest
    assert job_name_for(failed) != job_name_for(retried)


def test_digest_depends_on_the_lineage() -> None:
    assert manifest_of(ref(1), ref(2), lineage="main").digest != manifest_of(ref(1), ref(2), lineage="faces").digest


def test_digest_depends_on_a_shard_being_replayed() -> None:
    assert manifest_of(ref(1), ref(2)).digest != manifest_of(ref(1), ref(2, role="replay")).digest


# --- manifest_file --------------------------------------------------------------------------------

def test_manifest_file_is_a_prefix_then_relative_keys() -> None:
    assert manifest_file(manifest_of(ref(1), ref(2))) == [{"prefix": f"s3://{DATA}/shards/"},
                                                          f"{shard(1).shard_id}.tar", f"{shard(2).shard_id}.tar"]


def test_manifest_file_lists_replay_shards_too() -> None:
    manifest = manifest_of(ref(1), ref(101, role="replay"))

    assert manifest_file(manifest) == [{"prefix": f"s3://{DATA}/shards/"},
                                       f"{shard(1).shard_id}.tar", f"{shard(101).shard_id}.tar"]


# --- training_job_request -------------------------------------------------------------------------

DIGEST = "ab" * 32
REQUEST = training_job_request("atelier-0123456789abcdef0123", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)


def test_request_names_the_job() -> None:
    assert REQUEST["TrainingJobName"] == "atelier-0123456789abcdef0123"


def test_request_streams_its_one_channel_with_fast_file_sharded_by_key() -> None:
    assert REQUEST["AlgorithmSpecification"] == {"TrainingImage": "atelier-trainer:latest",
                                                 "TrainingInputMode": "FastFile",
                                                 "MetricDefinitions": METRIC_DEFINITIONS}
    assert REQUEST["InputDataConfig"] == [{
        "ChannelName": "train", "InputMode": "FastFile", "ContentType": "application/x-tar",
        "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile", "S3Uri": MANIFEST_URI,
                                        "S3DataDistributionType": "ShardedByS3Key"}},
    }]


def test_request_checkpoints_per_lineage() -> None:
    # not per job: a retried job and the lineage's next job resume from the same prefix
    assert REQUEST["CheckpointConfig"] == {"S3Uri": f"s3://{MODELS}/checkpoints/main/",
                                           "LocalPath": "/opt/ml/checkpoints"}
    other = training_job_request("atelier-ffffffffffffffffffff", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)
    assert other["CheckpointConfig"] == REQUEST["CheckpointConfig"]


def test_request_checkpoint_prefix_follows_the_lineage() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100,
                                   dataclasses.replace(SETTINGS, lineage="faces"))

    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{MODELS}/checkpoints/faces/"


def test_request_sends_tensorboard_files_to_the_job_s_own_prefix() -> None:
    from contracts.container_paths import TENSORBOARD_LOCAL_PATH as LOCAL_PATH
    assert REQUEST["TensorBoardOutputConfig"] == {"S3OutputPath": f"s3://{MODELS}/tensorboard/atelier-0123456789abcdef0123/",
                                                  "LocalPath": LOCAL_PATH}
    assert LOCAL_PATH == "/opt/ml/output/tensorboard"  # SageMaker's default LocalPath, where the trainer writes


def test_request_writes_models_under_training() -> None:
    assert REQUEST["OutputDataConfig"] == {"S3OutputPath": f"s3://{MODELS}/training/"}


def test_request_takes_resources_and_limits_from_settings() -> None:
    assert (REQUEST["RoleArn"], REQUEST["ResourceConfig"], REQUEST["StoppingCondition"], REQUEST["RetryStrategy"]) == (
        "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
        {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200},
        {"MaxRuntimeInSeconds": 432000},
        {"MaximumRetryAttempts": 3},
    )


def test_request_isolates_the_network_and_encrypts_between_containers() -> None:
    assert (REQUEST["EnableNetworkIsolation"], REQUEST["EnableInterContainerTrafficEncryption"]) == (True, True)


def test_request_tags_the_manifest_digest_lineage_and_stage() -> None:
    assert REQUEST["Tags"] == [{"Key": "atelier:manifest", "Value": DIGEST},
                               {"Key": "atelier:lineage", "Value": "main"},
                               {"Key": "atelier:stage", "Value": "main"},
                               {"Key": "atelier:final-stage", "Value": "true"}]


def test_request_without_warm_pool_vpc_or_key_leaves_them_out() -> None:
    assert "KeepAlivePeriodInSeconds" not in REQUEST["ResourceConfig"]
    assert "VolumeKmsKeyId" not in REQUEST["ResourceConfig"]
    assert "KmsKeyId" not in REQUEST["OutputDataConfig"]
    assert "VpcConfig" not in REQUEST


def test_request_keeps_a_warm_pool_when_asked() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100,
                                   dataclasses.replace(SETTINGS, keep_alive_s=600))

    assert request["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200,
                                         "KeepAlivePeriodInSeconds": 600}


def test_request_runs_in_the_vpc_when_subnets_are_given() -> None:
    settings = dataclasses.replace(SETTINGS, subnets=("subnet-a", "subnet-b"), security_groups=("sg-1",))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert request["VpcConfig"] == {"Subnets": ["subnet-a", "subnet-b"], "SecurityGroupIds": ["sg-1"]}


KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@pytest.mark.parametrize("instance_type", ["ml.m5.xlarge", "ml.p3.16xlarge", "ml.c5.9xlarge", "ml.inf2.xlarge"])
def test_request_encrypts_an_ebs_volume_and_the_outputs_with_the_key(instance_type: str) -> None:
    settings = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(PlannedJob("main", instance_type, 1, BASE_HPS),))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert request["OutputDataConfig"] == {"S3OutputPath": f"s3://{MODELS}/training/", "KmsKeyId": KEY}
    assert request["ResourceConfig"]["VolumeKmsKeyId"] == KEY


# AWS: "You can't request a VolumeKmsKeyId when using an instance type with local storage" (the API
# reference's ResourceConfig; docs/aws-differences.md). The outputs are still encrypted with the key.
@pytest.mark.parametrize("instance_type", ["ml.p5.48xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.g5.2xlarge",
                                           "ml.g4dn.xlarge", "ml.g6e.12xlarge", "ml.p3dn.24xlarge", "ml.trn1.32xlarge",
                                           "ml.m5d.large"])
def test_request_sends_no_volume_key_for_an_instance_store_type(instance_type: str) -> None:
    settings = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(PlannedJob("main", instance_type, 1, BASE_HPS),))

    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, settings)

    assert "VolumeKmsKeyId" not in request["ResourceConfig"]
    assert request["OutputDataConfig"]["KmsKeyId"] == KEY


def test_each_stage_of_a_run_plan_gets_the_volume_key_its_instance_type_allows() -> None:
    plan = dataclasses.replace(SETTINGS, kms_key=KEY, run_plan=(
        PlannedJob("256", "ml.p5.48xlarge", 4, BASE_HPS), PlannedJob("512", "ml.p3.16xlarge", 2, BASE_HPS)))

    first, second = (training_job_request("atelier-x", MANIFEST_URI, DIGEST, stage, 100, plan) for stage in (0, 1))

    assert ("VolumeKmsKeyId" in first["ResourceConfig"], second["ResourceConfig"]["VolumeKmsKeyId"]) == (False, KEY)


def test_request_hyperparameters_are_the_stage_s_with_steps_as_the_lineage_target() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 350, SETTINGS)

    assert request["HyperParameters"] == {"steps": "350", "batch-size": "32", "resolution": "256", "seed": "0"}


def test_request_hyperparameters_are_a_copy() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 100, SETTINGS)
    request["HyperParameters"]["batch-size"] = "1"

    assert SETTINGS.run_plan[0].hyperparameters["batch-size"] == "32"


def test_stage_hyperparameters_are_strings_with_steps_replaced() -> None:
    assert planned_job_hyperparameters(TWO_STAGES.run_plan[1], 80000) == {
        "steps": "80000", "batch-size": "32", "resolution": "512", "seed": "0"}


def test_request_for_an_earlier_stage_uses_its_instances_and_is_not_final() -> None:
    request = training_job_request("atelier-x", MANIFEST_URI, DIGEST, 0, 50000, TWO_STAGES)

    assert request["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 4, "VolumeSizeInGB": 200}
    assert request["HyperParameters"]["resolution"] == "256"
    assert request["Tags"][2:] == [{"Key": "atelier:stage", "Value": "256"},
                                   {"Key": "atelier:final-stage", "Value": "false"}]


def test_request_for_the_last_stage_uses_its_instances_and_is_final() -> None:
    request = training_job_request("atelier-x-s1", MANIFEST_URI, DIGEST, 1, 80000, TWO_STAGES)

    assert request["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 8, "VolumeSizeInGB": 200}
    assert request["HyperParameters"] == {"steps": "80000", "batch-size": "32", "resolution": "512", "seed": "0"}
    assert request["Tags"][2:] == [{"Key": "atelier:stage", "Value": "512"},
                                   {"Key": "atelier:final-stage", "Value": "true"}]


def test_every_option_on_is_a_valid_create_training_job_request() -> None:
    # botocore's own model of CreateTrainingJob (moto does not validate inputs: AWS-NOTES)
    settings = dataclasses.replace(TWO_STAGES, keep_alive_s=600, subnets=("subnet-a",), security_groups=("sg-1",),
                                   kms_key="arn:aws:kms:us-east-1:123456789012:key/k")
    shape = boto3.client("sagemaker", region_name="us-east-1").meta.service_model.operation_model(
        "CreateTrainingJob").input_shape

    for stage in (0, 1):
        validate_parameters(training_job_request(job_name_for(manifest_of(ref(1)), stage), MANIFEST_URI, DIGEST,
                                                 stage, 80000, settings), shape)


# --- metric definitions against the trainer's log lines -------------------------------------------

def trainer_line(**figures: object) -> str:
    """A training log line as trainer/jobs/train.py prints it (health.log: json.dumps of the fields)."""
    fields = {"step": 10, "stage": 0, "lr": 0.0001, "loss": 0.123, "grad_norm": 1.5, "img_per_s": 12.5,
              "data_wait_share": 0.01, "skipped_steps": 0, "corrupt_samples": 0}
    return json.dumps({**fields, **figures})


def metric(name: str, line: str) -> str | None:
    regex = next(d["Regex"] for d in METRIC_DEFINITIONS if d["Name"] == name)
    found = re.search(regex, line)
    return found.group(1) if found else None


def test_metric_names_are_the_trainer_s_figures() -> None:
    assert [d["Name"] for d in METRIC_DEFINITIONS] == [
        "train:loss", "train:lr", "train:grad_norm", "train:img_per_s", "train:data_wait_share",
        "train:skipped_steps", "train:corrupt_samples"]


@pytest.mark.parametrize(("name", "value"), [
    ("train:loss", "0.123"), ("train:lr", "0.0001"), ("train:img_per_s", "12.5"),
    ("train:data_wait_share", "0.01"), ("train:grad_norm", "1.5"),
])
def test_each_metric_regex_captures_its_value_from_a_trainer_line(name: str, value: str) -> None:
    line = '{"step": 10, "loss": 0.123, "lr": 0.0001, "img_per_s": 12.5, "data_wait_share": 0.01, "grad_norm": 1.5}'

    assert metric(name, line) == value
    assert metric(name, trainer_line()) == value


@pytest.mark.parametrize(("name", "figures", "value"), [
    ("train:lr", {"lr": 1e-05}, "1e-05"),  # json.dumps writes small floats in exponent notation
    ("train:lr", {"lr": 3.3333333333333335e-07}, "3.3333333333333335e-07"),
    ("train:loss", {"loss": 1.2e-05}, "1.2e-05"),
    ("train:loss", {"loss": -0.5}, "-0.5"),
    ("train:grad_norm", {"grad_norm": 3e-06}, "3e-06"),
    ("train:img_per_s", {"img_per_s": 812}, "812"),
    ("train:data_wait_share", {"data_wait_share": 0.0}, "0.0"),
])
def test_metric_regexes_capture_whole_numbers_as_json_writes_them(name: str, figures: dict, value: str) -> None:
    assert metric(name, trainer_line(**figures)) == value


def test_loss_of_a_window_of_skipped_steps_is_no_metric() -> None:
    # health.Window.figures writes "loss": null when every step of the window was skipped
    assert metric("train:loss", trainer_line(loss=None)) is None


@pytest.mark.parametrize("line", [
    json.dumps({"event": "saved", "model_dir": "/opt/ml/model", "steps": 100, "final_loss": 0.2}),
    json.dumps({"event": "start", "step": 0, "steps": 100, "world_size": 8, "device": "cuda:0"}),
    json.dumps({"event": "checkpoint", "step": 10, "dir": "/opt/ml/checkpoints/step-10"}),
])
def test_other_trainer_lines_give_no_metric(line: str) -> None:
    assert [metric(d["Name"], line) for d in METRIC_DEFINITIONS] == [None] * len(METRIC_DEFINITIONS)
