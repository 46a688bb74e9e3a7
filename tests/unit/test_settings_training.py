"""The start-training function's settings (core/start_training/settings.py): hyperparameters, the run plan,
quota against instances and GPUs, latent shards (what a job would refuse: test_settings_refusals.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.unit.settings_helpers import expanded  # noqa: F401 (a fixture)
from tests.unit.settings_helpers import (
    DEPLOY_ENV,
    TRAINING_ENV,
    TRAINING_OPTIONAL,
    TRAINING_REQUIRED,
    function_environment,
)

from atelier.local.template import Expanded
from contracts.recipe_file import packaged
from core.errors import ConfigError
from core.deploy.settings import DeploySettings
from core.start_training.run_plan import PlannedJob, check_sharding
from core.start_training.settings import TrainingSettings
from core.start_training.instance_types import GPUS_PER_INSTANCE

@pytest.mark.parametrize("raw", [
    pytest.param("steps=100", id="not-json"),
    pytest.param("{'steps': '100'}", id="python-dict"),
    pytest.param('["steps", "100"]', id="list"),
    pytest.param('"steps"', id="string"),
    pytest.param("100", id="number"),
    pytest.param("null", id="null"),
])
def test_hyperparameters_that_are_not_a_json_object_are_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_HYPERPARAMETERS"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})


def test_hyperparameter_values_become_strings() -> None:
    raw = json.dumps({"steps": 30, "learning-rate": 0.0005, "model-config": "tiny"})

    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})

    assert settings.run_plan[0].hyperparameters == {"steps": "30", "learning-rate": "0.0005", "model-config": "tiny"}


def test_empty_hyperparameter_object_is_allowed() -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": "{}"}).run_plan[0].hyperparameters == {}


@pytest.mark.parametrize("raw", [
    pytest.param('{"model": {"depth": 2}}', id="nested-object"),
    pytest.param('{"betas": [0.9, 0.999]}', id="list"),
])
def test_hyperparameters_that_are_not_flat_are_a_config_error(raw: str) -> None:
    # "a flat map of strings; reject anything else early" (core.settings._hyperparameters): a
    # nested value would reach the trainer as a Python repr such as "{'depth': 2}".
    with pytest.raises(ConfigError, match="TRAINING_HYPERPARAMETERS"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": raw})


@pytest.mark.parametrize(("hyperparameters", "message"), [
    pytest.param({f"h{i}": "1" for i in range(101)}, "has 101 entries; SageMaker takes at most 100", id="101-entries"),
    pytest.param({"prompts": "p" * 2501}, "'prompts' is over SageMaker's 256 characters a name or 2500 a value",
                 id="long-value"),
    pytest.param({"k" * 257: "1"}, "over SageMaker's 256 characters a name", id="long-name"),
    pytest.param({"validation-prompts": "a red circle\na blue square"}, "'validation-prompts' holds a line break",
                 id="line-break"),
])
def test_hyperparameters_aws_would_refuse_fail_the_function_at_start(hyperparameters: dict, message: str) -> None:
    # CreateTrainingJob's HyperParameters (botocore's model): 100 entries, 256 / 2,500 characters, pattern `.*`
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})
    with pytest.raises(ConfigError, match=re.escape(message)):
        DeploySettings.from_env({**DEPLOY_ENV, "EVAL_HYPERPARAMETERS": json.dumps(hyperparameters)})


def test_hyperparameters_at_the_limits_are_taken() -> None:
    # the evaluation job's (not a recipe yet, so any name): the limits alone decide
    hyperparameters = {f"h{i}": "v" * 2500 for i in range(99)} | {"k" * 256: "1"}

    settings = DeploySettings.from_env({**DEPLOY_ENV, "EVAL_HYPERPARAMETERS": json.dumps(hyperparameters)})

    assert settings.eval_hyperparameters == hyperparameters


def test_a_training_value_at_the_limit_is_taken() -> None:
    hyperparameters = {"validation-prompts": "|".join(["a red circle on a blue background"] * 75)[:2500]}

    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})

    assert settings.run_plan[0].hyperparameters == hyperparameters and len(hyperparameters["validation-prompts"]) == 2500


def test_a_hyperparameter_the_trainer_does_not_know_fails_the_function_at_start_naming_the_nearest() -> None:
    hyperparameters = {"lerning-rate": "1e-4", "batch-size": "2", "sagemaker_program": "train"}

    with pytest.raises(ConfigError, match=re.escape("'lerning-rate' is not an option of the job (did you mean "
                                                    "'learning-rate'?)")):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_HYPERPARAMETERS": json.dumps(hyperparameters)})


# --- training: the new variables ------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING_OPTIONAL)
@pytest.mark.parametrize("absent", ["missing", "empty"])
def test_optional_training_variables_absent_mean_none(name: str, absent: str) -> None:
    others = {k: v for k, v in TRAINING_ENV.items() if k != name and k in TRAINING_REQUIRED}
    env = others if absent == "missing" else {**others, name: ""}

    settings = TrainingSettings.from_env(env)

    assert (settings.subnets, settings.security_groups, settings.kms_key, len(settings.run_plan)) == ((), (), "", 1)


def test_subnets_and_security_groups_are_trimmed_lists() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_SUBNETS": " subnet-a , ,subnet-b ",
                                          "TRAINING_SECURITY_GROUPS": "sg-1,sg-2"})

    assert (settings.subnets, settings.security_groups) == (("subnet-a", "subnet-b"), ("sg-1", "sg-2"))


@pytest.mark.parametrize("missing", ["TRAINING_SUBNETS", "TRAINING_SECURITY_GROUPS"])
def test_subnets_and_security_groups_go_together(missing: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_SUBNETS and TRAINING_SECURITY_GROUPS"):
        TrainingSettings.from_env({**TRAINING_ENV, missing: ""})


@pytest.mark.parametrize("value", ["skip", "queue"])
def test_concurrency_is_queue_or_skip(value: str) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_CONCURRENCY": value}).concurrency == value


@pytest.mark.parametrize("value", ["parallel", "Queue", "wait", "both"])
def test_other_concurrency_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_CONCURRENCY"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_CONCURRENCY": value})


@pytest.mark.parametrize(("value", "share"), [("0", 0.0), ("0.5", 0.5), ("0.9", 0.9)])
def test_replay_share_up_to_nine_tenths_is_accepted(value: str, share: float) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_REPLAY_SHARE": value}).replay_share == share


@pytest.mark.parametrize("value", ["0.95", "1", "-0.1", "nan", "a fifth"])
def test_replay_share_out_of_0_to_0_9_is_a_config_error(value: str) -> None:
    # at a share of 1 the replay count round(n * r / (1 - r)) divides by zero
    with pytest.raises(ConfigError, match="TRAINING_REPLAY_SHARE"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_REPLAY_SHARE": value})


@pytest.mark.parametrize(("value", "seconds"), [("0", 0), ("3600", 3600)])
def test_keep_alive_of_0_to_an_hour_is_accepted(value: str, seconds: int) -> None:
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_KEEP_ALIVE_S": value}).keep_alive_s == seconds


@pytest.mark.parametrize("value", ["3601", "-1"])
def test_keep_alive_beyond_sagemaker_s_hour_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_KEEP_ALIVE_S"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_KEEP_ALIVE_S": value})


@pytest.mark.parametrize(("name", "value"), [
    pytest.param("TRAINING_INSTANCE_COUNT", "0", id="no-instances"),  # template: MinValue 1
    pytest.param("TRAINING_GPUS_PER_INSTANCE", "-1", id="negative-gpus"),  # template: MinValue 0
])
def test_training_count_out_of_its_range_is_a_config_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TrainingSettings.from_env({**TRAINING_ENV, name: value})


def test_kms_key_is_kept_as_given() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV).kms_key == "arn:aws:kms:us-east-1:123456789012:key/1234abcd"


# --- training: the run plan -------------------------------------------------------------------------

PLAN = json.dumps([
    {"name": "256", "instance_count": 4, "hyperparameters": {"resolution": "256", "steps": 50000}},
    {"name": "512", "instance_type": "ml.p4d.24xlarge", "instance_count": 8, "hyperparameters": {"resolution": "512"}},
])


@pytest.mark.parametrize("raw", ["", "[]"])
def test_empty_run_plan_is_one_stage_of_the_base_settings(raw: str) -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": raw})

    assert settings.run_plan == (PlannedJob("main", "ml.p5.48xlarge", 2, {"steps": "100000", "batch-size": "32"}),)
    assert settings.run_plan[0].steps == 100000


def test_run_plan_stages_override_instances_and_hyperparameters() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "64", "TRAINING_RUN_PLAN": PLAN})

    assert settings.run_plan == (
        PlannedJob("256", "ml.p5.48xlarge", 4, {"steps": "50000", "batch-size": "32", "resolution": "256"}),
        PlannedJob("512", "ml.p4d.24xlarge", 8, {"steps": "100000", "batch-size": "32", "resolution": "512"}),
    )
    assert [s.steps for s in settings.run_plan] == [50000, 100000]


def test_stage_without_steps_trains_none() -> None:
    assert PlannedJob("s", "ml.p5.48xlarge", 1, {}).steps == 0


@pytest.mark.parametrize("raw", [
    pytest.param("[{", id="not-json"),
    pytest.param('{"name": "256"}', id="object"),
    pytest.param('"256"', id="string"),
    pytest.param('[{"instance_count": 2}]', id="stage-without-name"),
    pytest.param('[{"name": 256}]', id="name-not-a-string"),
    pytest.param('["256"]', id="stage-not-an-object"),
    pytest.param('[{"name": "256"}, {"hyperparameters": {}}]', id="second-stage-without-name"),
])
def test_malformed_run_plan_is_a_config_error_naming_it(raw: str) -> None:
    with pytest.raises(ConfigError, match="TRAINING_RUN_PLAN"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": raw})


@pytest.mark.parametrize("stage", [
    pytest.param({"name": "a", "instance_count": "four"}, id="count-not-a-number"),
    pytest.param({"name": "a", "instance_count": 0}, id="count-zero"),
    pytest.param({"name": "a", "hyperparameters": {"betas": [0.9, 0.999]}}, id="nested-hyperparameter"),
    pytest.param({"name": "a", "hyperparameters": ["steps", "1"]}, id="hyperparameters-not-an-object"),
])
def test_malformed_stage_is_a_config_error_naming_the_run_plan(stage: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="TRAINING_RUN_PLAN"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": json.dumps([stage])})


# --- training: quota versus instances and GPUs ----------------------------------------------------

def test_p5_and_p4d_have_eight_gpus() -> None:
    assert (GPUS_PER_INSTANCE["ml.p5.48xlarge"], GPUS_PER_INSTANCE["ml.p4d.24xlarge"]) == (8, 8)


def test_quota_that_does_not_split_evenly_over_the_instances_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="quota of 30 shards does not split evenly over 4 instances"):
        check_sharding(30, PlannedJob("256", "ml.p5.48xlarge", 4, {}), 0)


def test_fewer_shards_per_instance_than_gpus_is_a_config_error_naming_the_minimum_quota() -> None:
    with pytest.raises(ConfigError, match="4 shards per instance for 8 GPUs; "
                                          "raise TrainingQuota to at least 16"):
        check_sharding(8, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "1"}), 0)


def test_loader_workers_need_no_shards_of_their_own() -> None:
    # the loader's workers share batches, not shards: 8 shards serve 8 GPUs with 4 workers each
    check_sharding(8, PlannedJob("256", "ml.p5.48xlarge", 1, {"num-workers": "4"}), 0)


def test_shards_that_do_not_split_evenly_over_an_instance_s_gpus_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="12 shards per instance do not split evenly over 8 GPUs; use a multiple of 16"):
        check_sharding(24, PlannedJob("256", "ml.p5.48xlarge", 2, {}), 0)


@pytest.mark.parametrize(("quota", "stage"), [
    (16, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "1"})),  # 8 per instance, one per GPU
    (32, PlannedJob("256", "ml.p5.48xlarge", 2, {"num-workers": "2"})),
    (1, PlannedJob("cpu", "ml.m5.xlarge", 1, {"num-workers": "1"})),  # a type not in the table: one process
    (2, PlannedJob("cpu", "ml.m5.xlarge", 2, {"num-workers": "1"})),
    (4, PlannedJob("cpu", "ml.m5.xlarge", 2, {})),  # no num-workers: the trainer's default of 2
])
def test_quota_with_whole_shards_for_every_gpu_passes(quota: int, stage: PlannedJob) -> None:
    check_sharding(quota, stage, 0)


def test_gpus_per_instance_override_replaces_the_instance_table() -> None:
    check_sharding(4, PlannedJob("256", "ml.p5.48xlarge", 1, {"num-workers": "1"}), 4)
    with pytest.raises(ConfigError, match="at least 2"):
        check_sharding(1, PlannedJob("cpu", "ml.m5.xlarge", 1, {"num-workers": "1"}), 2)


def test_settings_check_every_stage_of_the_run_plan() -> None:
    # 32 shards are enough for 4 p5 instances (8 each) but not for 8 p4d instances (4 each)
    with pytest.raises(ConfigError, match="run-plan job 512: 4 shards per instance for 8 GPUs"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "32", "TRAINING_RUN_PLAN": PLAN})


def test_settings_check_the_base_stage() -> None:
    with pytest.raises(ConfigError, match="raise TrainingQuota to at least 16"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8"})


def test_settings_take_the_gpus_per_instance_override() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_QUOTA": "8", "TRAINING_GPUS_PER_INSTANCE": "4"})

    assert settings.quota == 8
    with pytest.raises(ConfigError, match="at least 32"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_GPUS_PER_INSTANCE": "16"})

def test_template_and_default_recipe_parse_to_exact_settings(expanded: Expanded) -> None:
    parsed = TrainingSettings.from_env({**function_environment(expanded, "StartTrainingFunction"),
                                        **packaged().settings()})

    assert (parsed.quota, parsed.max_retries, parsed.lineage, parsed.concurrency, parsed.replay_share,
            parsed.keep_alive_s, parsed.subnets, parsed.security_groups, parsed.kms_key) \
        == (8, 3, "main", "queue", 0.2, 600, (), (), "")
    # progressive resolution 256 -> 512 -> 1024, one job (and one encode job) per stage, over the base hyperparameters
    base = {"learning-rate": "0.0001", "checkpoint-every": "1000", "seed": "0", "model-config": "sd2"}
    assert parsed.encode_instance_type and parsed.run_plan == (
        PlannedJob("256", "ml.p5.48xlarge", 1, {**base, "steps": "200000", "batch-size": "256", "resolution": "256",
                                          "lr-warmup-steps": "10000"}),
        PlannedJob("512", "ml.p5.48xlarge", 1, {**base, "steps": "100000", "batch-size": "64", "resolution": "512",
                                          "gradient-accumulation": "2", "lr-warmup-steps": "1000"}),
        PlannedJob("1024", "ml.p5.48xlarge", 1, {**base, "steps": "50000", "batch-size": "8", "resolution": "1024",
                                           "learning-rate": "0.00005", "lr-warmup-steps": "1000"}))


def test_the_default_run_plan_runs_each_stage_the_fastest_measured_way(expanded: Expanded) -> None:
    """trainer/configs/defaults/fast.json measured the fastest batch and accumulation per preset and resolution:
    the default recipe's stages use exactly those, so the default job is the measured one."""
    from trainer.speed.fast_defaults import table

    stages = TrainingSettings.from_env({**function_environment(expanded, "StartTrainingFunction"),
                                        **packaged().settings()}).run_plan
    measured = {(stage.hyperparameters["model-config"], int(stage.hyperparameters["resolution"])): stage for stage in stages}
    matched = [key for key in measured if key in table()]
    assert matched == [("sd2", 256), ("sd2", 512)]  # 1024 is not measured for sd2 yet: it runs eager, batch 8
    for key in matched:
        fast, hyperparameters = table()[key], measured[key].hyperparameters
        assert (int(hyperparameters["batch-size"]), int(hyperparameters.get("gradient-accumulation", "1"))) \
            == (fast.batch_size, fast.gradient_accumulation), key


# --- training: latent shards ----------------------------------------------------------------------

@pytest.mark.parametrize("hyperparameters, refusal", [
    ({"run-config": "sd2-progressive"}, "'hi': run-config: the pipeline sets each job's steps"),
    ({"resolution": "500"}, "'hi': resolution '500' must be a whole number of pixels, a multiple of 8"),
    ({"resolution": "big"}, "'hi': resolution 'big' must be a whole number"),
])
def test_a_stage_latent_shards_cannot_serve_is_refused_before_any_encode_job(hyperparameters, refusal) -> None:
    plan = json.dumps([{"name": "lo"}, {"name": "hi", "hyperparameters": hyperparameters}])
    with pytest.raises(ConfigError, match=refusal):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge",
                                   "TRAINING_RUN_PLAN": plan})


def test_no_encode_instance_type_trains_on_image_shards() -> None:
    assert TrainingSettings.from_env(TRAINING_ENV).encode_instance_type == ""
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": " "}).encode_instance_type == ""


def test_an_encode_instance_type_is_read() -> None:
    settings = TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge"})

    assert settings.encode_instance_type == "ml.g5.2xlarge"


def test_random_crops_on_latent_shards_are_a_config_error_naming_the_stage() -> None:
    plan = json.dumps([{"name": "lo"}, {"name": "hi", "hyperparameters": {"random-crop": "true"}}])

    with pytest.raises(ConfigError, match="'hi' asks for random-crop"):
        TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_ENCODE_INSTANCE_TYPE": "ml.g5.2xlarge",
                                   "TRAINING_RUN_PLAN": plan})
    assert TrainingSettings.from_env({**TRAINING_ENV, "TRAINING_RUN_PLAN": plan}).run_plan[1].name == "hi"
