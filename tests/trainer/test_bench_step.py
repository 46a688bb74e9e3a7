"""bench/train_gpu.py on the CPU with the tiny model: it times trainer.step.train_step and prints its JSON lines."""

import json
import sys
import time

import pytest
import torch

import trainer.step
from bench import train_gpu
from trainer.distributed import Processes
from trainer.models import load_models
from trainer.step import StepSettings

CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)


@pytest.fixture
def steps_run(monkeypatch):
    """(step number, settings) of every trainer.step.train_step call."""
    calls, real_step = [], trainer.step.train_step

    def recording_step(trainee, models, batches, window, settings, step, processes):
        calls.append((step, settings))
        return real_step(trainee, models, batches, window, settings, step, processes)

    monkeypatch.setattr(trainer.step, "train_step", recording_step)
    return calls


def test_a_configuration_runs_the_trainer_s_step_with_the_trainer_s_settings(steps_run, tmp_path):
    # GIVEN the bench's shared state around the tiny model, and resident latents with two micro-batches per step
    args = train_gpu.argparse.Namespace(seed=3, num_workers=0, shards=str(tmp_path), count_flops=False)
    bench = train_gpu.Bench(args, load_models("tiny", None, seed=0), CPU, {}, set(), {32: 2})
    config = train_gpu.parse_config("resident32+accum2")
    # WHEN it runs 1 warm-up and 2 timed steps
    result = train_gpu.run_config(bench, config, steps=2, warmup=1, first=True)
    # THEN every step was train_step's, with the trainer's settings but for the seed and the accumulation
    assert steps_run == [(step, StepSettings(seed=3, gradient_accumulation=2)) for step in (1, 2, 3)]
    assert (result["batch"], result["images_per_step"], result["timed_steps"], result["skipped_steps"]) == (2, 4, 2, 0)
    assert result["loss"] > 0 and result["img_per_s"] > 0
    assert list(bench.marks) == ["loader_started", "first_batch", "first_step"]
    assert all(p.grad is None for p in bench.models.unet.parameters())  # released for the next configuration


def test_the_benchmark_prints_its_metric_lines(steps_run, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_gpu.py", "--model-config", "tiny", "--configs", "resident32,resident32+b4",
                                      "--steps", "1", "--warmup", "0", "--num-workers", "0"])
    monkeypatch.setattr(train_gpu, "PROCESS_START", time.time())
    train_gpu.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["metric"] for line in lines] == [
        "train.config.resident32", "train.first_step_s", "train.data_wait_share", "train.config.resident32+b4"]
    assert lines[3]["config"]["batch"] == 4 and lines[3]["plain_img_per_s"] == lines[0]["value"]
    assert [step for step, _ in steps_run] == [1, 1]
