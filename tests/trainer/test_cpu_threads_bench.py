"""bench/cpu_threads.py: it times the demo's UNet step at each thread count and prints its JSON lines."""

import json

import pytest
import torch

from bench import cpu_threads


def test_the_bench_prints_a_line_per_thread_count_and_their_ratio(capsys):
    before = torch.get_num_threads()
    try:
        cpu_threads.main(["--threads", "1,2", "--rounds", "1", "--steps", "1"])
    finally:
        torch.set_num_threads(before)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["metric"] for line in lines] == [
        "train.cpu_step_ms_threads_1", "train.cpu_step_ms_threads_2", "train.cpu_threads_speedup"]
    assert all(line["value"] > 0 for line in lines) and lines[0]["cpu_ms"] > 0
    assert lines[2]["threads"] == [1, 2]
    assert lines[2]["value"] == pytest.approx(lines[0]["value"] / lines[1]["value"], rel=0.01)
    assert lines[2]["config"]["model_config"] == "demo" and lines[2]["config"]["resolution"] == 32
    assert lines[2]["config"]["batch"] == 64  # the demo's recipe (recipes/local.toml)


def test_two_presets_alternate_and_their_ratio_is_printed_per_thread_count(capsys, monkeypatch):
    fed = []
    real = cpu_threads.step_function
    monkeypatch.setattr(cpu_threads, "step_function", lambda preset, resolution, batch: fed.append(preset) or real(preset, resolution, batch))
    before = torch.get_num_threads()
    try:
        cpu_threads.main(["--model-config", "demo,tiny", "--threads", "1", "--rounds", "1", "--steps", "1", "--batch-size", "2"])
    finally:
        torch.set_num_threads(before)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert fed == ["demo", "tiny"]
    assert [(line["metric"], line["config"]["model_config"]) for line in lines] == [
        ("train.cpu_step_ms_threads_1", "demo"), ("train.cpu_step_ms_threads_1", "tiny"),
        ("train.cpu_threads_speedup", "demo"), ("train.cpu_step_ratio_presets", "demo,tiny")]
    assert lines[3]["value"] == pytest.approx(lines[0]["value"] / lines[1]["value"], rel=0.01) and lines[3]["threads"] == 1



def test_busy_keeps_other_processes_spinning_while_the_block_runs_and_stops_them_after():
    import multiprocessing
    with cpu_threads.busy(2):
        spinners = multiprocessing.active_children()
        assert len(spinners) >= 2 and all(child.is_alive() for child in spinners)
        cpu = [child.pid for child in spinners]
    assert not any(child.pid in cpu for child in multiprocessing.active_children())
