"""The training benchmarks (bench/train_*.py) on the CPU with the tiny model: they time trainer.jobs.step.train_step
and print their JSON lines."""

import json
import sys
import time

import pytest
import torch

import trainer.jobs.step
from bench import train_configs, train_fp8_parity, train_harness, train_throughput, train_timing
from trainer.jobs.step import StepSettings
from trainer.models.loading import load_models
from trainer.runtime.distributed import Processes

CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)


@pytest.fixture
def steps_run(monkeypatch):
    """(step number, settings) of every trainer.jobs.step.train_step call."""
    calls, real_step = [], trainer.jobs.step.train_step

    def recording_step(trainee, models, batches, window, settings, step, processes):
        calls.append((step, settings))
        return real_step(trainee, models, batches, window, settings, step, processes)

    monkeypatch.setattr(trainer.jobs.step, "train_step", recording_step)
    return calls


def test_a_configuration_runs_the_trainer_s_step_with_the_trainer_s_settings(steps_run, tmp_path):
    # GIVEN the bench's shared state around the tiny model, and resident latents with two micro-batches per step
    args = train_harness.argparse.Namespace(seed=3, num_workers=0, shards=str(tmp_path), count_flops=False)
    bench = train_harness.Bench(args, load_models("tiny", None, seed=0), CPU, {}, set(), {32: 2})
    config = train_configs.parse_config("resident32+accum2")
    # WHEN it runs 1 warm-up and 2 timed steps
    result = train_timing.run_config(bench, config, steps=2, warmup=1, first=True)
    # THEN every step was train_step's, with the trainer's settings but for the seed and the accumulation
    assert steps_run == [(step, StepSettings(seed=3, gradient_accumulation=2)) for step in (1, 2, 3)]
    assert (result["batch"], result["images_per_step"], result["timed_steps"], result["skipped_steps"]) == (2, 4, 2, 0)
    assert result["loss"] > 0 and result["img_per_s"] > 0
    assert list(bench.marks) == ["loader_started", "first_batch", "first_step"]
    assert all(p.grad is None for p in bench.models.denoiser.parameters())  # released for the next configuration


def test_the_benchmark_prints_its_metric_lines(steps_run, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", "--model-config", "tiny", "--configs", "resident32,resident32+b4",
                                      "--steps", "1", "--warmup", "0", "--num-workers", "0"])
    monkeypatch.setattr(train_harness, "PROCESS_START", time.time())
    train_throughput.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["metric"] for line in lines] == [
        "train.config.resident32", "train.first_step_s", "train.data_wait_share", "train.config.resident32+b4"]
    assert lines[3]["config"]["batch"] == 4 and lines[3]["plain_img_per_s"] == lines[0]["value"]
    assert [step for step, _ in steps_run] == [1, 1]


def test_the_issue_23_levers_parse_on_top_of_the_default():
    bf16w, fp8, gnsilu = (train_configs.parse_config(f"latent512+default+{lever}") for lever in ("bf16w", "fp8", "gnsilu"))
    assert (bf16w.bf16_weights, bf16w.fp8, bf16w.fused_groupnorm_silu, bf16w.fast_default) == (True, False, False, True)
    assert (fp8.bf16_weights, fp8.fp8, fp8.fused_groupnorm_silu) == (False, True, False)
    assert (gnsilu.bf16_weights, gnsilu.fp8, gnsilu.fused_groupnorm_silu) == (False, False, True)
    assert train_configs.without_last_lever(bf16w.name) == "latent512+default"
    with pytest.raises(ValueError):
        train_configs.parse_config("latent512+bf16w+fp32")


def tiny_bench(tmp_path) -> train_harness.Bench:
    args = train_harness.argparse.Namespace(seed=3, num_workers=0, shards=str(tmp_path), count_flops=False)
    return train_harness.Bench(args, load_models("tiny", None, seed=0), CPU, {}, set(), {32: 2})


@pytest.mark.parametrize("lever", ["bf16w", "gnsilu"])
def test_a_model_lever_runs_the_trainer_s_step_and_is_released(lever, steps_run, tmp_path):
    # GIVEN the tiny model's bench and its UNet's parameter names and values before
    bench = tiny_bench(tmp_path)
    unet = bench.models.denoiser
    before = {name: param.detach().clone() for name, param in unet.named_parameters()}
    modules = [type(module) for module in unet.modules()]
    # WHEN a configuration with the lever runs 1 warm-up and 2 timed steps of train_step on the CPU
    result = train_timing.run_config(bench, train_configs.parse_config(f"resident32+accum2+{lever}"), steps=2, warmup=1,
                                  first=False)
    # THEN every step was train_step's and finite, and the weights moved
    assert [step for step, _ in steps_run] == [1, 2, 3] and result["skipped_steps"] == 0
    assert len(result["losses"]) == 3 and all(loss > 0 for loss in result["losses"])
    after = dict(unet.named_parameters())
    assert list(after) == list(before) and any(not torch.equal(after[name], before[name]) for name in before)
    # AND release left fp32 weights, the UNet's own module types and no gradients for the next configuration
    assert all(param.dtype == torch.float32 and param.grad is None for param in unet.parameters())
    assert [type(module) for module in unet.modules()] == modules
    assert bench.master_weights is None
    if lever == "gnsilu":
        assert result["groupnorm_silu_blocks"] > 0 and result["groupnorm_silu_path"].startswith("pytorch")


def test_fp8_and_its_parity_run_are_skipped_lines_on_a_cpu(steps_run, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_fp8_parity.py", "--model-config", "tiny", "--configs", "resident32,resident32+fp8",
                                      "--steps", "1", "--warmup", "0", "--num-workers", "0", "--parity-steps", "2",
                                      "--parity-base", "resident32"])
    monkeypatch.setattr(train_harness, "PROCESS_START", time.time())
    train_fp8_parity.main()
    lines = {line["metric"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert lines["train.config.resident32+fp8"]["value"] is None
    assert lines["train.config.resident32+fp8"]["skipped"] == "float8 training needs a CUDA device"
    assert lines["train.lever.fp8_loss_parity"]["skipped"] == "float8 training needs a CUDA device"
    assert [step for step, _ in steps_run] == [1]  # resident32 alone ran


def test_the_parity_run_starts_both_curves_from_the_same_weights_seed_and_data(steps_run, monkeypatch, tmp_path):
    # GIVEN a stand-in for torchao whose conversion changes nothing, so both runs must give the very same losses
    import types
    converted = []
    fake = types.ModuleType("torchao.float8")
    fake.Float8LinearConfig = lambda: None
    fake.convert_to_float8_training = lambda unet, module_filter_fn, config: converted.append(module_filter_fn)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    monkeypatch.setattr(train_fp8_parity, "fp8_unavailable", lambda device: None)
    bench = tiny_bench(tmp_path)
    bench.args.model_config = "tiny"
    before = {name: param.detach().clone() for name, param in bench.models.denoiser.named_parameters()}
    # WHEN the parity run takes 3 steps of each
    line = train_fp8_parity.fp8_parity_line(bench, "resident32", 3)
    # THEN both curves are equal step for step, the ratio is 1, and the UNet is left as it started
    curves = line["curves"]
    assert curves["resident32"] == curves["resident32+fp8"] and len(curves["resident32"]) == 3
    assert line["value"] == 1.0 and line["tail_steps"] == 3 and len(converted) == 1
    assert [step for step, _ in steps_run] == [1, 2, 3, 1, 2, 3]
    assert all(torch.equal(param, before[name]) for name, param in bench.models.denoiser.named_parameters())
