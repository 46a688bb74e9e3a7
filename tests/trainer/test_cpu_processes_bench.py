"""bench/cpu_processes.py: one process, more threads, or data-parallel processes, timed in turn."""

import json

import pytest

from bench import cpu_processes


def test_the_bench_times_each_way_and_the_ddp_way_runs_across_its_processes(capsys):
    cpu_processes.main(["--processes", "2", "--rounds", "1", "--steps", "1", "--batch-size", "4"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["metric"] for line in lines] == [
        "train.cpu_step_ms_one", "train.cpu_step_ms_threads", "train.cpu_step_ms_ddp", "train.cpu_processes_speedup"]
    assert [line["ranks"] for line in lines[:3]] == [1, 1, 2]  # the ddp way's process group spans both processes
    assert all(line["value"] > 0 for line in lines)
    assert lines[3]["value"] == pytest.approx(lines[0]["value"] / lines[2]["value"], rel=0.01)
    assert lines[3]["threads_speedup"] == pytest.approx(lines[0]["value"] / lines[1]["value"], rel=0.01)
    assert lines[3]["config"]["batch"] == 4 and lines[3]["config"]["processes"] == 2


def test_processes_must_split_the_batch():
    with pytest.raises(SystemExit, match="divides --batch-size"):
        cpu_processes.main(["--processes", "3", "--batch-size", "64"])


def test_the_autoencoder_s_step_is_timed_under_its_own_names(capsys):
    cpu_processes.main(["--part", "vae", "--processes", "2", "--rounds", "1", "--steps", "1", "--batch-size", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["metric"] for line in lines] == [
        "autoencoder.cpu_step_ms_one", "autoencoder.cpu_step_ms_threads", "autoencoder.cpu_step_ms_ddp",
        "autoencoder.cpu_processes_speedup"]
    assert [line["ranks"] for line in lines[:3]] == [1, 1, 2] and lines[3]["config"]["part"] == "vae"
