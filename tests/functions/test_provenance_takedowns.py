"""Provenance under moto: takedowns left out of the next manifest and never drawn, license terms."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import LeftOut
from core import aws
from core.partners import licensing
from core.partners.licensing import Revocation, revoke
from core.provenance import Affected, affected_by
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_job_finished
from trainer.jobs import encode
from tests.functions.provenance_helpers import (  # noqa: F401  (fixtures)
    TAKEDOWN_AT,
    channel_as_sagemaker_lays_it_out,
    clean,
    configure,
    drawn_keys,
    manifest,
    pack,
    pictures,
    requests,
    seal,
    settings,
    small_parts,
    stack,
)


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
