"""The lineage's own VAE, under moto with resources from template.yaml and SageMaker as AWS has it
(training_jobs_helpers.FakeSageMaker): without a base, the autoencoder job `<job>-ae` before a lineage's
first job, and its model.tar.gz as the `vae` channel of every later job of the lineage.
"""

from __future__ import annotations

from typing import Any, Callable

import boto3
import pytest

from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training import autoencoder_job, manifests
from core.start_training.manifests import job_name_for
from core.start_training.starter import StartDecision
from tests.functions.autoencoder_helpers import (  # noqa: F401  (autoencoding: fixtures)
    AE_HYPERPARAMETERS,
    ENCODE,
    ON,
    autoencoded,
    autoencoder_done,
    autoencoding,
    channels,
    vae_of,
)
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure: fixtures)
    TWO_STAGES,
    FakeSageMaker,
    configure,
    expected_manifest,
    finish,
    handle,
    job,
    lineage,
    manifest_uri,
    pending,
    put_latents,
    sagemaker,
    seal,
    sid,
    stack,
    tags,
)
from tests.support import load_event


# --- no base: an autoencoder job first ---------------------------------------------------------------

def test_without_a_base_the_first_claim_starts_only_the_autoencoder_job(autoencoding: TrainingSettings,
                                                                        sagemaker: FakeSageMaker) -> None:
    boto3.client("s3").put_object(Bucket=autoencoding.data_bucket, Key="eval/heldout-0.tar", Body=b"held out")

    decision = seal(autoencoding, 1, 2)[1]

    name = job_name_for(expected_manifest(autoencoding, [1, 2]))
    request = sagemaker.request(f"{name}-ae")
    assert decision == StartDecision("started", name, 2)
    assert sagemaker.created == [f"{name}-ae"]  # no encode or training job before the lineage has a VAE
    assert request["HyperParameters"] == {"task": "autoencoder", "resolution": "32", "model-config": "tiny",
                                          **AE_HYPERPARAMETERS}
    assert channels(request) == {"train": manifest_uri(autoencoding, name),
                                 "validation": f"s3://{autoencoding.data_bucket}/eval/"}
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "ShardedByS3Key"
    assert (request["ResourceConfig"]["InstanceType"], request["ResourceConfig"]["InstanceCount"]) == ("ml.g5.2xlarge", 1)
    assert request["OutputDataConfig"]["S3OutputPath"] == f"s3://{autoencoding.models_bucket}/autoencoder/"
    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{autoencoding.models_bucket}/checkpoints/main-ae/"
    assert {k: tags(request)[k] for k in ("atelier:role", "atelier:final-stage", "atelier:training-job")} == {
        "atelier:role": "autoencoder", "atelier:final-stage": "false", "atelier:training-job": name}
    assert {k: job(autoencoding, f"{name}-ae")[k] for k in ("role", "for_job", "status", "lineage")} == {
        "role": "autoencoder", "for_job": name, "status": "Requested", "lineage": "main"}
    assert (job(autoencoding, name)["autoencoder"], job(autoencoding, name)["pretrained"]) == (True, "")
    assert (lineage(autoencoding)["autoencoder"], lineage(autoencoding)["running_job"]) == (True, name)


def test_without_held_out_shards_the_autoencoder_job_has_no_validation_channel(autoencoding: TrainingSettings,
                                                                               sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name

    assert list(channels(sagemaker.request(f"{name}-ae"))) == ["train"]  # SageMaker fails a job on an empty channel


def test_the_autoencoder_job_reads_the_exclusion_list_of_its_training_job(autoencoding: TrainingSettings,
                                                                          sagemaker: FakeSageMaker,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifests, "manifest_from", _with_exclusion(manifests.manifest_from))

    name = seal(autoencoding, 1, 2)[1].job_name

    assert channels(sagemaker.request(f"{name}-ae"))["manifest"] == f"s3://{autoencoding.data_bucket}/manifests/{name}.json"


def _with_exclusion(manifest_from: Callable[..., Any]) -> Callable[..., Any]:
    """manifest_from, leaving one sample of the first shard out (as a takedown would)."""
    def build(*args: Any, **kwargs: Any) -> Any:
        manifest = manifest_from(*args, **kwargs)
        return manifest and manifest.model_copy(update={"exclude": {sid(1): ("a" * 64,)}})
    return build


def test_a_completed_autoencoder_job_gives_the_lineage_its_vae_and_starts_the_encode_job_with_it(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    settings = configure(**ON, **ENCODE)
    name = seal(settings, 1, 2)[1].job_name

    decision = autoencoded(sagemaker, settings, name)

    vae = vae_of(settings, name)
    assert decision == StartDecision("autoencoded", name)
    assert sagemaker.created == [f"{name}-ae", f"{name}-enc"]
    encode = sagemaker.request(f"{name}-enc")
    assert channels(encode) == {"train": manifest_uri(settings, name), "vae": vae}
    assert encode["HyperParameters"] == {"task": "encode", "resolution": "32", "model-config": "tiny", "vae": "vae"}
    assert (lineage(settings)["vae_uri"], lineage(settings)["autoencoder_job"]) == (vae, f"{name}-ae")
    assert (job(settings, name)["vae_uri"], job(settings, name)["autoencoder_job"]) == (vae, f"{name}-ae")
    assert job(settings, f"{name}-ae")["status"] == "Completed"


def test_the_stage_s_cpu_threads_reach_its_autoencoder_and_encode_jobs(configure: Callable[..., TrainingSettings],
                                                                      sagemaker: FakeSageMaker) -> None:
    # GIVEN a stage that runs its jobs on one CPU thread (the local demo's samconfig.toml)
    hyperparameters = {"steps": "2", "batch-size": "2", "resolution": "32", "model-config": "tiny", "cpu-threads": "1"}
    settings = configure(**ON, **ENCODE, recipe={"training": {"hyperparameters": hyperparameters}})
    # WHEN its first job starts with the autoencoder, then the encode job
    name = seal(settings, 1, 2)[1].job_name
    autoencoded(sagemaker, settings, name)
    # THEN both helper jobs carry the setting, as the training job does
    assert sagemaker.request(f"{name}-ae")["HyperParameters"]["cpu-threads"] == "1"
    assert sagemaker.request(f"{name}-enc")["HyperParameters"] == {"task": "encode", "resolution": "32", "model-config": "tiny",
                                                                  "cpu-threads": "1", "vae": "vae"}


def test_the_encode_job_s_end_starts_training_with_the_same_vae(configure: Callable[..., TrainingSettings],
                                                                 sagemaker: FakeSageMaker) -> None:
    settings = configure(**ON, **ENCODE)
    name = seal(settings, 1, 2)[1].job_name
    autoencoded(sagemaker, settings, name)
    put_latents(settings, name, 1, 2)

    assert finish(settings, f"{name}-enc", "Completed") == StartDecision("encoded", name)

    train = sagemaker.request(name)
    assert sagemaker.created == [f"{name}-ae", f"{name}-enc", name]
    assert channels(train) == {"train": f"s3://{settings.data_bucket}/manifests/{name}.latents.manifest",
                               "vae": vae_of(settings, name)}
    assert train["HyperParameters"] == {"steps": "2", "batch-size": "2", "resolution": "32", "model-config": "tiny",
                                        "vae": "vae"}


def test_without_encoding_the_autoencoder_s_end_starts_training_on_the_image_shards(
        autoencoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name

    autoencoded(sagemaker, autoencoding, name)

    assert sagemaker.created == [f"{name}-ae", name]
    assert channels(sagemaker.request(name)) == {"train": manifest_uri(autoencoding, name),
                                                 "vae": vae_of(autoencoding, name)}


def test_the_lineage_s_next_manifest_reads_the_same_vae_and_trains_no_second_one(autoencoding: TrainingSettings,
                                                                                 sagemaker: FakeSageMaker) -> None:
    # GIVEN a first manifest waiting for the lineage's VAE, and a second queued behind it meanwhile
    first, _, second = (d.job_name for d in seal(autoencoding, 1, 2, 3, 4)[1:])
    assert job(autoencoding, second)["autoencoder"] is True
    autoencoded(sagemaker, autoencoding, first)

    # WHEN the first job completes
    assert finish(autoencoding, first, "Completed") == StartDecision("started", second)

    # THEN the second starts at once on the first's VAE: one autoencoder job for the lineage
    assert sagemaker.created == [f"{first}-ae", first, second]
    assert channels(sagemaker.request(second))["vae"] == vae_of(autoencoding, first)
    assert job(autoencoding, second)["autoencoder_job"] == f"{first}-ae"


def test_a_manifest_claimed_after_the_vae_reads_it_too(autoencoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    first = seal(autoencoding, 1, 2)[1].job_name
    autoencoded(sagemaker, autoencoding, first)
    finish(autoencoding, first, "Completed")

    second = seal(autoencoding, 3, 4)[1].job_name

    assert sagemaker.created == [f"{first}-ae", first, second]
    assert channels(sagemaker.request(second))["vae"] == vae_of(autoencoding, first)


def test_every_stage_of_the_run_plan_reads_the_lineage_s_vae(configure: Callable[..., TrainingSettings],
                                                            sagemaker: FakeSageMaker) -> None:
    settings = configure(**ON, recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    autoencoded(sagemaker, settings, base)

    finish(settings, base, "Completed")

    assert sagemaker.created == [f"{base}-ae", base, f"{base}-s1"]
    assert channels(sagemaker.request(f"{base}-s1"))["vae"] == vae_of(settings, base)


def test_a_failed_autoencoder_job_fails_its_training_job_and_returns_the_shards(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    name = seal(configure(**ON), 1, 2)[1].job_name
    settings = configure(**ON, TRAINING_QUOTA="4")  # nothing claims them again

    decision = finish(settings, f"{name}-ae", "Failed", "AlgorithmError: loss became NaN")

    assert decision == StartDecision("autoencoder-failed", name)
    assert (job(settings, name)["status"], job(settings, name)["failure_reason"]) == (
        "Failed", f"autoencoder job {name}-ae Failed: AlgorithmError: loss became NaN")
    assert pending(settings) == [sid(1), sid(2)]
    assert lineage(settings)["running_job"] == "" and "vae_uri" not in lineage(settings)
    assert sagemaker.created == [f"{name}-ae"]


def test_after_a_stopped_autoencoder_job_the_next_job_trains_a_vae_again(autoencoding: TrainingSettings,
                                                                        sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name

    finish(autoencoding, f"{name}-ae", "Stopped", "MaxRuntimeExceeded")

    retry = job_name_for(expected_manifest(autoencoding, [1, 2], sequence=2))
    assert sagemaker.created == [f"{name}-ae", f"{retry}-ae"]  # resuming checkpoints/main-ae/
    assert sagemaker.request(f"{retry}-ae")["CheckpointConfig"] == sagemaker.request(f"{name}-ae")["CheckpointConfig"]


def test_a_completed_autoencoder_job_without_an_artefact_fails_its_training_job(autoencoding: TrainingSettings,
                                                                                sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name
    sagemaker.jobs[f"{name}-ae"]["TrainingJobStatus"] = "Completed"

    assert finish(autoencoding, f"{name}-ae", "Completed") == StartDecision("autoencoder-failed", name)
    assert job(autoencoding, name)["failure_reason"] == f"autoencoder job {name}-ae Completed: no ModelArtifacts"


def test_redelivered_events_start_nothing_twice(autoencoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name
    seal(autoencoding, 1, 2)  # the Shard Sealed events again, while the autoencoder job runs
    assert sagemaker.created == [f"{name}-ae"]

    autoencoded(sagemaker, autoencoding, name)
    again = finish(autoencoding, f"{name}-ae", "Completed")

    assert again == StartDecision("autoencoded", name)
    assert sagemaker.created == [f"{name}-ae", name]
    # the claim's request, then the same again for each redelivered Shard Sealed event (refused)
    autoencoder_requests = [r for r in sagemaker.requests if r["TrainingJobName"] == f"{name}-ae"]
    assert autoencoder_requests == [autoencoder_requests[0]] * 3
    assert [r["TrainingJobName"] for r in sagemaker.requests].count(name) == 2  # the redelivery's refused
    assert lineage(autoencoding)["vae_uri"] == vae_of(autoencoding, name)


def test_a_lineage_s_vae_is_never_replaced(autoencoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name
    autoencoded(sagemaker, autoencoding, name)

    assert autoencoder_job.store_vae("atelier-other-ae", "s3://elsewhere/model.tar.gz", autoencoding) is False
    assert (lineage(autoencoding)["vae_uri"], lineage(autoencoding)["autoencoder_job"]) == (
        vae_of(autoencoding, name), f"{name}-ae")


def test_a_lost_autoencoder_completed_event_is_made_good_by_the_next_event(autoencoding: TrainingSettings,
                                                                         sagemaker: FakeSageMaker) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name
    autoencoder_done(sagemaker, autoencoding, name)  # its event never came

    seal(autoencoding, 3)  # any later event of the lineage looks at the running job

    assert sagemaker.created == [f"{name}-ae", name]
    assert job(autoencoding, f"{name}-ae")["status"] == "Completed"
    assert lineage(autoencoding)["vae_uri"] == vae_of(autoencoding, name)


def test_a_lineage_that_trained_before_keeps_its_vae(autoencoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a lineage whose jobs trained before autoencoder jobs were decided (on a random frozen VAE)
    aws.put_item(autoencoding.table, {"pk": "LINEAGE#main", "kind": "lineage", "sequence": 1, "steps_done": 2,
                                      "queue": [], "running_job": ""})

    name = seal(autoencoding, 1, 2)[1].job_name

    # THEN its next job trains at once: a new VAE would move the latent space its UNet learned
    assert sagemaker.created == [name]
    assert (job(autoencoding, name)["autoencoder"], lineage(autoencoding)["autoencoder"]) == (False, False)


def test_the_handler_starts_the_training_job_when_the_autoencoder_completes(autoencoding: TrainingSettings,
                                                                          sagemaker: FakeSageMaker,
                                                                          lambda_context: Any) -> None:
    name = seal(autoencoding, 1, 2)[1].job_name
    autoencoder_done(sagemaker, autoencoding, name)
    event = load_event("start_training_autoencoder_completed")
    event["detail"]["TrainingJobName"] = f"{name}-ae"

    assert handle(event, lambda_context) == {"action": "autoencoded", "job": name}
    assert sagemaker.created == [f"{name}-ae", name]
