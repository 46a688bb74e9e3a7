"""The start-training function refuses, before any job is paid for, what a job would refuse at its start: a
stage's resolution off its preset's size multiple, a preset that is none, the options a preset's family cannot
take, an SD3 preset's bucket past its position table, and what the pipeline sets itself."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit.settings_helpers import TRAINING_ENV

from contracts import model_presets
from contracts.recipe import TrainOptions
from core.errors import ConfigError
from core.start_training.settings import TrainingSettings


# --- training: a stage's resolution, by its model preset -------------------------------------------

@pytest.mark.parametrize("encode_instance_type", ["", "ml.g5.2xlarge"])
def test_a_stage_off_its_preset_s_size_multiple_is_refused_before_any_job(encode_instance_type: str) -> None:
    # 520 is a multiple of 8 (the VAE's downsampling) but not of sd2's 64 (VAE x UNet downsampling)
    plan = json.dumps([{"name": "lo", "hyperparameters": {"resolution": "512"}},
                       {"name": "hi", "hyperparameters": {"model-config": "sd2", "resolution": "520"}}])
    with pytest.raises(ConfigError, match="'hi': resolution '520' must be a whole number of pixels, a multiple of 64 "
                                          r"\(model-config 'sd2'"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": encode_instance_type,
                                   "TRAINING_RUN_PLAN": plan})


@pytest.mark.parametrize("preset, resolution", [("sd2", "512"), ("sdxl", "1056"), ("sd3-medium", "528"),
                                                ("pixart-sigma", "1040"), ("tiny-sd3", "40")])
def test_a_stage_on_its_preset_s_size_multiple_is_accepted(preset: str, resolution: str) -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": {"model-config": preset, "resolution": resolution}}])
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan}).run_plan[0].name == "only"


@pytest.mark.parametrize("resolution, pixels", [("256 ", 256), ("+256", 256), ("²", None), ("0", None), ("-64", None)])
def test_a_stage_s_resolution_is_read_as_the_trainer_reads_it(resolution: str, pixels: int | None) -> None:
    # "²".isdigit() holds but int("²") fails: the check must answer with a refusal, never crash the function
    plan = json.dumps([{"name": "only", "hyperparameters": {"resolution": resolution}}])
    if pixels is None:
        with pytest.raises(ConfigError, match=f"'only': resolution {re.escape(repr(resolution))} must be a whole number"):
            TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan})
    else:
        assert TrainOptions.model_validate({"resolution": resolution}).resolution == pixels
        assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan}).run_plan[0].name == "only"


def test_a_model_config_that_is_no_preset_is_refused() -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": {"model-config": "huge"}}])
    with pytest.raises(ConfigError) as refused:
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan})
    presets = ", ".join(sorted(model_presets.SIZE_MULTIPLES))
    assert str(refused.value).endswith(f"run-plan job 'only': model-config 'huge' is not a preset: {presets}")
    assert {"pixart-sigma", "sd2", "sd3-medium", "tiny"} <= set(model_presets.SIZE_MULTIPLES)


@pytest.mark.parametrize("hyperparameters, refusal", [
    ({"manifest": ""}, "hyperparameter 'manifest' is the pipeline's to set"),  # it would drop the exclusions
    ({"task": "evaluate"}, "hyperparameter 'task' is the pipeline's to set"),
    ({"train-dir": "/tmp/x"}, "hyperparameter 'train-dir' is the pipeline's to set"),
    ({"run-config": "sd2-progressive"}, "run-config: the pipeline sets each job's steps and plans a lineage's phases"),
    ({"model-config": "tiny-sd3", "noise-offset": "0.05"}, "--noise-offset: options of the UNet family's noise schedule"),
    ({"model-config": "pixart-sigma", "zero-terminal-snr": "true"}, "--zero-terminal-snr: options of the UNet family"),
    ({"model-config": "tiny-sd3", "resolution": "256"}, "the widest image side at resolution 256 is 352 px"),
    ({"zero-terminal-snr": "true"}, "--zero-terminal-snr needs --prediction-type v_prediction"),  # tiny predicts epsilon
])
def test_what_a_job_would_refuse_at_its_start_is_refused_before_any_job(hyperparameters, refusal) -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": hyperparameters}])
    with pytest.raises(ConfigError, match=f"run-plan job 'only': {re.escape(refusal)}"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan})


def test_a_base_s_family_is_the_base_s_to_decide_not_the_preset_s() -> None:
    plan = json.dumps([{"name": "only", "hyperparameters": {"model-config": "tiny-sd3", "noise-offset": "0.05",
                                                            "resolution": "256"}}])
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan,
                                          "TRAINING_PRETRAINED_MODEL_URI": "s3://models/base/"})
    assert settings.run_plan[0].hyperparameters["noise-offset"] == "0.05"  # the trainer checks the base's as it loads


def test_cuda_graphs_forced_on_a_job_of_several_processes_is_refused_before_any_job() -> None:
    plan = json.dumps([{"name": "one", "instance_type": "ml.g5.2xlarge", "instance_count": 1,
                        "hyperparameters": {"cuda-graphs": "true"}},
                       {"name": "eight", "instance_type": "ml.p4d.24xlarge", "instance_count": 1,
                        "hyperparameters": {"cuda-graphs": "true"}}])
    with pytest.raises(ConfigError, match=r"run-plan job 'eight': cuda-graphs true runs in a single process, and this "
                                          r"job runs 8 \(1 x ml.p4d.24xlarge\)"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8", "TRAINING_RUN_PLAN": plan})
    auto = json.dumps([{"name": "eight", "instance_type": "ml.p4d.24xlarge", "instance_count": 1,
                        "hyperparameters": {"cuda-graphs": "auto"}}])
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8", "TRAINING_RUN_PLAN": auto}).run_plan


@pytest.mark.parametrize("instance_type", ["ml.c5.2xlarge", "ml.g4ad.4xlarge", "ml.trn1.2xlarge"])
def test_cuda_graphs_forced_on_an_instance_without_an_nvidia_gpu_is_refused_before_any_job(instance_type: str) -> None:
    plan = json.dumps([{"name": "cpu", "instance_type": instance_type, "instance_count": 1,
                        "hyperparameters": {"cuda-graphs": "true"}}])
    with pytest.raises(ConfigError, match=f"run-plan job 'cpu': cuda-graphs true needs a CUDA device, and "
                                          f"{re.escape(instance_type)} has no NVIDIA GPU"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan})
    # the operator's TRAINING_GPUS_PER_INSTANCE vouches for a GPU the table does not know
    vouched = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan, "TRAINING_GPUS_PER_INSTANCE": "1"})
    assert vouched.run_plan[0].name == "cpu"


def test_a_job_of_several_instances_with_no_tokenizer_to_share_is_refused_before_any_job() -> None:
    # GIVEN no base and no tokenizer job: each host would learn its own tokenizer from its own shards
    alone = {**TRAINING_ENV, "TRAINING_TOKENIZER_INSTANCE_TYPE": ""}
    with pytest.raises(ConfigError, match="run-plan job 'main' runs on 2 instances with no tokenizer"):
        TrainingSettings.from_env(alone)
    # one instance learns one; a base brings its own (or the lineage's tokenizer job learns one)
    assert TrainingSettings.from_env({**alone, "TRAINING_INSTANCE_COUNT": "1", "TRAINING_QUOTA": "8"}).run_plan
    assert TrainingSettings.from_env({**alone, "TRAINING_PRETRAINED_MODEL_URI": "s3://models/base/"}).run_plan


def test_an_autoencoder_resolution_off_its_vae_s_downsampling_is_refused_before_any_job() -> None:
    # the tiny preset's VAE halves twice: 34 is no multiple of 4 (the autoencoder job would refuse it at its start)
    env = {**TRAINING_ENV, "TRAINING_AUTOENCODER_INSTANCE_TYPE": "ml.g5.2xlarge",
           "TRAINING_AUTOENCODER_HYPERPARAMETERS": json.dumps({"resolution": "34"})}
    with pytest.raises(ConfigError, match=r"run-plan job 'main''s autoencoder job: resolution '34' must be a whole number "
                                          r"of pixels, a multiple of 4 \(model-config 'tiny': its VAE's downsampling\)"):
        TrainingSettings.from_env(env)
    # 20 is one, though not of 8 (the training job's rule: the VAE's and the UNet's downsampling)
    ok = TrainingSettings.from_env({**env, "TRAINING_AUTOENCODER_HYPERPARAMETERS": json.dumps({"resolution": "20"})})
    assert ok.autoencoder_hyperparameters == {"resolution": "20"}
