"""trainer.runtime.preflight: two gloo processes, each its own host, check each other before anything loads."""

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from trainer.runtime import distributed, preflight
from trainer.runtime.distributed import Processes

TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def preflight_rank(rank: int, port: int, root: str, faulty_rank: int | None, absent_rank: int | None) -> None:
    """One rank of a two-process gloo job, as host algo-<rank + 1> with its own output dir and log."""
    host = f"algo-{rank + 1}"
    os.dup2(os.open(Path(root) / host / "stderr.log", os.O_WRONLY | os.O_CREAT), 2)  # the job log
    os.environ.update({"CUDA_VISIBLE_DEVICES": "", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "SM_CURRENT_HOST": host, "SM_OUTPUT_DIR": str(Path(root) / host)})
    if rank == faulty_rank:  # what this rank sends arrives changed, as over a bad link
        preflight.contribution = lambda rank: rank + 2.0
    processes = distributed.setup()
    if rank == absent_rank:  # in the process group, but never in the all-reduce
        time.sleep(120)
    figures = preflight.check(processes, TIMEOUT_S, min_free_fraction=0.8)
    (Path(root) / host / "figures.json").write_text(json.dumps(figures))
    distributed.teardown()


def run_ranks(root: Path, faulty_rank: int | None = None, absent_rank: int | None = None) -> list[int | None]:
    """Both ranks' exit codes (None: still running after the other ended, then stopped)."""
    for host in ("algo-1", "algo-2"):
        (root / host).mkdir()
    # forkserver: one clean process imports torch once, and every rank of every test forks from it
    context, port = multiprocessing.get_context("forkserver"), free_port()
    context.set_forkserver_preload(["trainer.runtime.distributed", "trainer.runtime.preflight"])
    ranks = [context.Process(target=preflight_rank, args=(rank, port, str(root), faulty_rank, absent_rank))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    present = [process for rank, process in enumerate(ranks) if rank != absent_rank]
    for process in present:
        process.join(timeout=120)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    return codes


def test_two_ranks_that_reach_each_other_pass_and_time_the_all_reduce(tmp_path):
    assert run_ranks(tmp_path) == [0, 0]
    for host in ("algo-1", "algo-2"):
        figures = json.loads((tmp_path / host / "figures.json").read_text())
        assert list(figures) == ["all_reduce_s"] and 0 < figures["all_reduce_s"] < TIMEOUT_S
        assert not (tmp_path / host / "failure").exists()


def test_a_wrong_all_reduce_result_fails_every_rank_with_host_rank_and_values(tmp_path):
    # GIVEN rank 1 contributes 3 instead of 2: the sum is 4 where 1 + 2 = 3 is expected
    codes = run_ranks(tmp_path, faulty_rank=1)
    # THEN both ranks end with a non-zero status, each host's failure file naming itself
    assert codes == [1, 1]
    for rank, host in enumerate(("algo-1", "algo-2")):
        assert (tmp_path / host / "failure").read_text() == (
            f"PreflightError: {host} rank {rank}: all_reduce gave 4, expected 3 (1048576 of 1048576 values wrong)\n")
        assert not (tmp_path / host / "figures.json").exists()


def test_an_all_reduce_a_peer_never_joins_ends_the_rank_at_the_bound_with_its_stacks(tmp_path):
    started = time.monotonic()
    codes = run_ranks(tmp_path, absent_rank=1)
    assert codes[0] == 1 and codes[1] is None
    assert time.monotonic() - started < 60  # the bound ended it, not gloo's 30-minute timeout
    assert (tmp_path / "algo-1" / "failure").read_text() == (
        "PreflightError: algo-1 rank 0: all_reduce did not finish within 2 s (a peer is down or cannot be reached)\n")
    assert "in check_all_reduce" in (tmp_path / "algo-1" / "stderr.log").read_text()  # the stuck frame (faulthandler)


def test_a_gpu_short_of_free_memory_fails_with_what_is_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * 2**30, 80 * 2**30))
    with pytest.raises(preflight.PreflightError) as error:
        preflight.check_memory(torch.device("cuda", 3), min_free_fraction=0.8)
    assert str(error.value) == "cuda:3 has 6.0 of 80.0 GiB free, under the 80% needed (is another process using it?)"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (79 * 2**30, 80 * 2**30))
    assert preflight.check_memory(torch.device("cuda", 3), min_free_fraction=0.8) == 0.988


def test_one_cpu_process_checks_its_compute_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SM_OUTPUT_DIR", str(tmp_path))
    assert preflight.check(Processes(0, 1, 0, 1, torch.device("cpu"), None), TIMEOUT_S, 0.8) == {}
    assert not (tmp_path / "failure").exists()
