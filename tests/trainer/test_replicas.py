"""trainer.runtime.distributed.replicas_agree: two gloo ranks compare their weights."""

import multiprocessing
import os
import socket

import torch

from trainer.runtime import distributed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_answer(rank: int, port: int, drift: float, answers) -> None:
    os.environ.update({"CUDA_VISIBLE_DEVICES": "", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    distributed.setup()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if rank == 1:
        with torch.no_grad():
            module[1].weight[0, 0] += drift
    answers.put((rank, distributed.replicas_agree(module)))
    distributed.teardown()


def answers_of(drift: float) -> dict[int, bool]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["trainer.runtime.distributed"])
    answers, port = context.Queue(), free_port()
    ranks = [context.Process(target=rank_answer, args=(rank, port, drift, answers)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    found = dict(answers.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    return found


def test_ranks_with_the_same_weights_agree_and_one_changed_weight_makes_every_rank_disagree():
    assert answers_of(0.0) == {0: True, 1: True}
    assert answers_of(1e-3) == {0: False, 1: False}


def test_one_process_agrees_with_itself():
    assert distributed.replicas_agree(torch.nn.Linear(2, 2))
