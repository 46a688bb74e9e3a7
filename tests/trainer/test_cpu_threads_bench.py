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
    assert lines[2]["config"]["model_config"] == "tiny" and lines[2]["config"]["resolution"] == 32
