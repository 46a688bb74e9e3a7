"""Provenance under moto: shards packed by the real packer, manifests built by the start-training
stage, and what the trainer then reads. Takedowns, license terms, lineage and attribution."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
import tarfile
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest
from PIL import Image

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import LeftOut, Manifest, Sample
from contracts.s3_layout import output_key
from core import aws
from core.pack.packer import pack_samples, seal_due
from core.partners import attribution, licensing
from core.partners.licensing import Partner, Revocation, Terms, put_partner, revoke
from core.provenance import Affected, affected_by, lineage_of
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished, on_shard_sealed
from tests.functions.pack_helpers import sealed_record, settings_for
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards, load_exclusions
from trainer.data.phases import RunPlan
from trainer.jobs import encode

TAKEDOWN_AT = "2026-12-01T10:00:00+00:00"


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    """conftest's `module_stack`: provisioned once here; `clean` empties the table and the buckets
    before each test."""
    return module_stack


@pytest.fixture(autouse=True)
def clean(stack: Provisioned) -> None:
    """The pipeline table and the buckets as the template leaves them: empty."""
    dynamodb, s3 = boto3.client("dynamodb"), boto3.client("s3")
    for page in dynamodb.get_paginator("scan").paginate(TableName=stack.outputs["PipelineTableName"],
                                                        ProjectionExpression="pk"):
        for item in page["Items"]:
            dynamodb.delete_item(TableName=stack.outputs["PipelineTableName"], Key=item)
    for bucket in (stack.outputs[n] for n in ("UploadsBucketName", "DataBucketName", "ModelsBucketName")):
        for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
            for version in page.get("Versions", []) + page.get("DeleteMarkers", []):
                s3.delete_object(Bucket=bucket, Key=version["Key"], VersionId=version["VersionId"])


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto enforces S3's 5 MiB smallest part; these shards are kilobytes (settings_for matches)."""
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """CreateTrainingJob requests by job name (SageMaker itself is not needed here)."""
    sent: dict[str, dict[str, Any]] = {}
    monkeypatch.setattr(aws, "create_training_job", lambda request: bool(sent.setdefault(request["TrainingJobName"], request)))
    return sent


@pytest.fixture
def configure(stack: Provisioned, function_env: Callable[[str], dict[str, str]], requests: dict,
              monkeypatch: pytest.MonkeyPatch) -> Callable[..., TrainingSettings]:
    """StartTrainingFunction's settings from the template (quota 2, no replay), partners registered."""
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0")
    table = stack.outputs["PipelineTableName"]
    put_partner(table, Partner(partner_id="partner-a", licenses=("CC-BY-4.0",)))
    put_partner(table, Partner(partner_id="partner-b", licenses=("CC-BY-4.0", "b-research"),
                               rules=(Terms(license="b-research", uses=("research",)),)))
    put_partner(table, Partner(partner_id="partner-c", licenses=("CC-BY-4.0",), rules=(Terms(not_after="2020-01-31"),)))

    def apply(**variables: str) -> TrainingSettings:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return TrainingSettings.from_env()
    return apply


@pytest.fixture
def settings(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure()


def picture(stack: Provisioned, n: int, partner: str = "partner-a", license: str = "CC-BY-4.0") -> Sample:
    """An accepted upload (a real 48 px JPEG) and its record, as ingest leaves them."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (48, 48), random.Random(n).randbytes(48 * 48 * 3)).save(buffer, format="JPEG")
    image, bucket, key = buffer.getvalue(), stack.outputs["UploadsBucketName"], f"{partner}/batch/{n:03d}.jpg"
    version = boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=image).get("VersionId", "")
    sha = hashlib.sha256(image).hexdigest()
    sample = Sample(sha256=sha, partner=partner, bucket=bucket, key=key, version_id=version, format="jpeg", width=48,
                    height=48, size=len(image), caption=f"picture {n}", license=license,
                    uploaded_at="2026-11-29T12:00:00.000Z", aspect_bucket="1:1", content_bucket=bucket, content_key=key,
                    content_sha256=sha)
    aws.put_item(stack.outputs["PipelineTableName"], pipeline_table.sample_item(sample))
    return sample


def pack(stack: Provisioned, samples: list[Sample]) -> str:
    """One shard of exactly these samples, sealed by the packer; its id."""
    settings = settings_for(stack)
    pack_samples([(f"m-{s.sha256[:8]}", s) for s in samples], settings)
    sealed = seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    assert len(sealed) == 1
    return sealed[0].shard_id


def seal(stack: Provisioned, settings: TrainingSettings, *shard_ids: str) -> str | None:
    """The Shard Sealed events of these shards reach the start-training stage; the last decision's job."""
    decisions = [on_shard_sealed(sealed_record(settings_for(stack), shard_id), settings) for shard_id in shard_ids]
    return decisions[-1].job_name


def manifest(settings: TrainingSettings, job: str) -> Manifest:
    return Manifest.model_validate_json(aws.read_object(settings.data_bucket, f"manifests/{job}.json"))


def pictures(stack: Provisioned, numbers: range, partner: str = "partner-a", license: str = "CC-BY-4.0") -> list[Sample]:
    return [picture(stack, n, partner, license) for n in numbers]


def channel_as_sagemaker_lays_it_out(settings: TrainingSettings, request: dict[str, Any], root: Path) -> dict[str, Path]:
    """Each channel of a CreateTrainingJob request downloaded under root/<channel>/ (one instance)."""
    dirs = {}
    for channel in request["InputDataConfig"]:
        source = channel["DataSource"]["S3DataSource"]
        bucket, key = source["S3Uri"].removeprefix("s3://").split("/", 1)
        target = dirs.setdefault(channel["ChannelName"], root / channel["ChannelName"])
        target.mkdir(parents=True)
        if source["S3DataType"] == "ManifestFile":  # its prefix may be in another bucket (latent shards)
            prefix, *relative = json.loads(aws.read_object(bucket, key))
            prefix_bucket, prefix_key = prefix["prefix"].removeprefix("s3://").split("/", 1)
            for name in relative:
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                (target / name).write_bytes(aws.read_object(prefix_bucket, prefix_key + name))
        else:
            (target / key.rsplit("/", 1)[1]).write_bytes(aws.read_object(bucket, key))
    return dirs


def drawn_keys(train_dir: Path, manifest_dir: Path | None, steps: int = 12) -> tuple[set[str], int]:
    """Every sample key the trainer's loader yields over `steps` batches of 2, and how many it excluded."""
    index = index_shards(train_dir, exclude=load_exclusions(manifest_dir))
    plan = RunPlan([{"resolution": 32, "batch_size": 2, "learning_rate": 1e-4, "steps": steps}])
    batches = StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, 8, True), 1, steps, 0.0, False)
    return {key for batch in make_loader(batches, 0) for key in batch["key"]}, index.excluded


# --- takedowns ----------------------------------------------------------------------------------

def test_a_revoked_sample_is_left_out_of_the_next_manifest_and_never_reaches_the_trainer(
        stack: Provisioned, settings: TrainingSettings, requests: dict, tmp_path: Path) -> None:
    # GIVEN two sealed shards, and a takedown of one sample of the first
    first, second = pictures(stack, range(0, 4)), pictures(stack, range(4, 8))
    shard_1, shard_2 = pack(stack, first), pack(stack, second)
    revoked = first[1]
    revoke(settings.table, Revocation(partner="partner-a", sha256s=(revoked.sha256,), reason="artist request",
                                      at=TAKEDOWN_AT))

    # WHEN the shards reach the quota
    job = seal(stack, settings, shard_1, shard_2)

    # THEN the manifest excludes exactly that sample, saying why, and the job reads the manifest too
    built = manifest(settings, job)
    assert built.exclude == {shard_1: (revoked.sha256,)}
    assert built.left_out == (LeftOut(shard_id=shard_1, sha256=revoked.sha256, partner="partner-a", license="CC-BY-4.0",
                                      reason="revoked 2026-12-01: artist request"),)
    assert requests[job]["InputDataConfig"][1] == {
        "ChannelName": "manifest", "InputMode": "File", "ContentType": "application/json",
        "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"s3://{settings.data_bucket}/manifests/{job}.json",
                                        "S3DataDistributionType": "FullyReplicated"}}}
    # AND the trainer's loader, on the channels as SageMaker lays them out, never yields it
    channels = channel_as_sagemaker_lays_it_out(settings, requests[job], tmp_path)
    drawn, excluded = drawn_keys(channels["train"], channels["manifest"])
    assert drawn == {s.sha256 for s in first + second} - {revoked.sha256}
    assert excluded == 1
    # (without the exclusion list the same shards do hold it: the shard itself is unchanged)
    assert revoked.sha256 in drawn_keys(channels["train"], None)[0]


def test_a_manifest_without_exclusions_reads_as_before(stack: Provisioned, settings: TrainingSettings,
                                                       requests: dict) -> None:
    job = seal(stack, settings, pack(stack, pictures(stack, range(0, 2))), pack(stack, pictures(stack, range(2, 4))))

    assert (manifest(settings, job).exclude, manifest(settings, job).left_out) == ({}, ())
    assert [c["ChannelName"] for c in requests[job]["InputDataConfig"]] == ["train", "indexes"]  # the shards' tables


ENCODING_ON = {"TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge"}  # the template's default; conftest turns it off


def manifest_channel(settings: TrainingSettings, job: str) -> dict[str, Any]:
    """The `manifest` channel that brings a job's exclusion list (its manifest JSON) to every instance."""
    return {"ChannelName": "manifest", "InputMode": "File", "ContentType": "application/json",
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix",
                                            "S3Uri": f"s3://{settings.data_bucket}/manifests/{job}.json",
                                            "S3DataDistributionType": "FullyReplicated"}}}


def test_with_encoding_on_the_encode_job_gets_the_exclusion_list_before_the_training_job(
        stack: Provisioned, configure: Callable[..., TrainingSettings], requests: dict) -> None:
    # GIVEN encoding on, two sealed shards, and a takedown of one sample of the first
    settings = configure(**ENCODING_ON)
    first = pictures(stack, range(0, 4))
    shard_1, shard_2 = pack(stack, first), pack(stack, pictures(stack, range(4, 8)))
    revoke(settings.table, Revocation(partner="partner-a", sha256s=(first[1].sha256,), reason="artist request"))

    # WHEN the shards reach the quota
    job = seal(stack, settings, shard_1, shard_2)

    # THEN what starts is the encode job, reading the image shards and the training job's exclusion list
    assert manifest(settings, job).exclude == {shard_1: (first[1].sha256,)}
    assert list(requests) == [f"{job}-enc"]
    assert [c["ChannelName"] for c in requests[f"{job}-enc"]["InputDataConfig"]] == ["train", "manifest", "indexes"]
    assert requests[f"{job}-enc"]["InputDataConfig"][1] == manifest_channel(settings, job)


def test_with_encoding_on_a_revoked_sample_is_never_encoded_nor_drawn(
        stack: Provisioned, configure: Callable[..., TrainingSettings], requests: dict, tmp_path: Path) -> None:
    # GIVEN encoding on, a takedown of one sample, and the encode job's request for the next manifest
    settings = configure(**ENCODING_ON)
    first, second = pictures(stack, range(0, 4)), pictures(stack, range(4, 8))
    shards = [pack(stack, first), pack(stack, second)]
    revoked = first[1].sha256
    revoke(settings.table, Revocation(partner="partner-a", sha256s=(revoked,), reason="artist request"))
    job = seal(stack, settings, *shards)
    request = requests[f"{job}-enc"]

    # WHEN trainer.jobs.encode runs on the encode job's channels as SageMaker lays them out, and its
    # latent shards reach S3 as CheckpointConfig uploads them
    channels = channel_as_sagemaker_lays_it_out(settings, request, tmp_path / "encode")
    hyperparameters = [arg for name, value in request["HyperParameters"].items() if name != "task"
                       for arg in (f"--{name}", value)]
    summary = encode.main(encode.parse_args(["--train-dir", str(channels["train"]), "--manifest", str(channels["manifest"]),
                                             "--output-dir", str(tmp_path / "checkpoints"), "--num-workers", "0",
                                             *hyperparameters]))
    latents = Path(summary["dir"])
    for path in latents.rglob("*.tar"):
        aws.write_object(settings.models_bucket, f"encoded/{job}/latents/{latents.name}/{path.relative_to(latents)}",
                         path.read_bytes(), "application/x-tar")
    on_job_finished(f"{job}-enc", "Completed", None, settings)

    # THEN the revoked sample was not encoded: the latent shards the training job reads do not hold it
    assert (summary["samples_encoded"], summary["samples_excluded"]) == (7, 1)
    channels = channel_as_sagemaker_lays_it_out(settings, requests[job], tmp_path / "train")
    everything = {s.sha256 for s in first + second}
    assert drawn_keys(channels["train"], None)[0] == everything - {revoked}
    # AND the training job on the latent shards still gets the exclusion list (and applies it: nothing left to skip)
    assert requests[job]["InputDataConfig"][1] == manifest_channel(settings, job)
    assert drawn_keys(channels["train"], channels["manifest"]) == (everything - {revoked}, 0)


def test_the_audit_lists_the_models_that_learned_from_a_revoked_sample(stack: Provisioned, settings: TrainingSettings) -> None:
    # GIVEN a job that completed on a sample, then a takedown of it
    first = pictures(stack, range(0, 4))
    job_1 = seal(stack, settings, pack(stack, first[:2]), pack(stack, first[2:]))
    on_job_finished(job_1, "Completed", None, settings)
    takedown = revoke(settings.table, Revocation(partner="partner-a", sha256s=(first[0].sha256,), reason="r"))
    # AND a later job, whose manifest leaves nothing out but which resumes the lineage's checkpoints
    job_2 = seal(stack, settings, pack(stack, pictures(stack, range(4, 6))), pack(stack, pictures(stack, range(6, 8))))
    on_job_finished(job_2, "Completed", None, settings)

    # WHEN the takedown is audited, THEN both models learned from it (the second through the first)
    assert manifest(settings, job_2).exclude == {}
    assert affected_by(takedown, settings) == [Affected(job=job_1, status="Completed", stage=0, samples=1),
                                               Affected(job=job_2, status="Completed", stage=0, samples=1)]
    # and a takedown of what no job used affects none
    other = Revocation(partner="partner-b", reason="r")
    assert affected_by(other, settings) == []


def test_a_takedown_is_recorded_once(settings: TrainingSettings) -> None:
    takedown = Revocation(partner="partner-a", license="CC-BY-4.0", reason="contract ended")
    first = revoke(settings.table, takedown)
    again = revoke(settings.table, takedown)

    assert again == first and first.at
    assert licensing.list_revocations(settings.table) == [first]


# --- license terms ------------------------------------------------------------------------------

def test_terms_leave_out_samples_and_whole_shards_and_the_manifest_says_why(stack: Provisioned,
                                                                          settings: TrainingSettings) -> None:
    # GIVEN partner-c's terms ended in 2020 and partner-b's b-research license allows research only
    expired = pack(stack, pictures(stack, range(0, 2), "partner-c"))
    research = pictures(stack, range(2, 4), "partner-b", "b-research")
    mixed = pack(stack, pictures(stack, range(4, 6)) + research)
    clean = pack(stack, pictures(stack, range(6, 8), "partner-b"))

    # WHEN the three shards are sealed (quota 2; this pipeline's use is commercial)
    assert settings.use == "commercial"
    job = seal(stack, settings, expired, mixed, clean)

    # THEN the expired shard is left out whole (for good), the research samples one by one
    built = manifest(settings, job)
    assert [s.shard_id for s in built.shards] == [mixed, clean]
    assert built.exclude == {mixed: tuple(sorted(s.sha256 for s in research))}
    whole = LeftOut(shard_id=expired, reason="every sample left out: terms of partner-c (every license): "
                                             "no training after 2020-01-31")
    assert [e for e in built.left_out if not e.sha256] == [whole]
    assert {(e.sha256, e.reason) for e in built.left_out if e.sha256} == {
        (s.sha256, "terms of partner-b (b-research): research use only, not commercial") for s in research}
    shard = aws.get_item(settings.table, pipeline_table.shard_pk(expired)) or {}
    assert (shard["status"], shard["excluded_reason"], "gsi1pk" in shard) == ("excluded", whole.reason, False)


def test_a_research_pipeline_may_train_on_research_only_samples(stack: Provisioned,
                                                                configure: Callable[..., TrainingSettings]) -> None:
    settings = configure(TRAINING_USE="research")
    research = pack(stack, pictures(stack, range(0, 2), "partner-b", "b-research"))

    job = seal(stack, settings, research, pack(stack, pictures(stack, range(2, 4))))

    assert manifest(settings, job).left_out == ()


# --- lineage and attribution ----------------------------------------------------------------------

TWO_STAGES = json.dumps([{"name": "lo", "hyperparameters": {"resolution": "32", "steps": "3"}},
                         {"name": "hi", "hyperparameters": {"resolution": "64", "steps": "5"}}])


def test_lineage_runs_through_every_stage_and_every_earlier_manifest(stack: Provisioned,
                                                                     configure: Callable[..., TrainingSettings]) -> None:
    # GIVEN two manifests of a two-stage run plan, each through both stages
    settings = configure(TRAINING_RUN_PLAN=TWO_STAGES)
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
