"""trainer.container: the image's entrypoint against a fake /opt/ml, as SageMaker would run it."""

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer import container

REPO_ROOT = Path(__file__).resolve().parents[2]

HYPERPARAMETERS = {
    "steps": "2",
    "batch-size": "2",
    "resolution": "32",
    "learning-rate": "0.0001",
    "checkpoint-every": "1",
    "seed": "0",
    "model-config": "tiny",
    "num-workers": "0",
    "validation-prompts": "a dog",
    "validation-inference-steps": "2",
}


def make_opt_ml(root: Path, shards_dir: Path | None, hyperparameters: dict = HYPERPARAMETERS) -> Path:
    """A SageMaker /opt/ml layout: config files, and the train channel holding the shards (if any)."""
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    (config / "inputdataconfig.json").write_text(json.dumps({
        "train": {"TrainingInputMode": "FastFile", "S3DistributionType": "ShardedByS3Key", "RecordWrapperType": "None"},
    }))
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    channel = root / "input" / "data" / "train"
    if shards_dir is None:
        channel.mkdir(parents=True)
    else:
        shutil.copytree(shards_dir, channel)
    return root


def run_container(root: Path, command: str, **environment) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.container", command],
        cwd=REPO_ROOT,
        env={**os.environ, "ATELIER_OPT_ML": str(root), **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_sm_variables_are_those_of_the_training_toolkit(tmp_path):
    root = make_opt_ml(tmp_path, None)
    assert container.sagemaker_environment(root) == {
        "SM_MODEL_DIR": str(root / "model"),
        "SM_OUTPUT_DIR": str(root / "output"),
        "SM_OUTPUT_DATA_DIR": str(root / "output" / "data"),
        "SM_CHANNELS": '["train"]',
        "SM_CHANNEL_TRAIN": str(root / "input" / "data" / "train"),
        "SM_HPS": json.dumps(HYPERPARAMETERS),
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SM_NUM_GPUS": str(torch.cuda.device_count()),
    }


def test_hyperparameters_become_arguments_with_the_checkpoint_dir(tmp_path):
    root = make_opt_ml(tmp_path, None, {"steps": "5", "model-config": "tiny", "sagemaker_region": '"eu-west-1"'})
    assert container.training_argv(root) == [
        "--steps", "5", "--model-config", "tiny", "--checkpoint-dir", str(root / "checkpoints"),
    ]


def test_one_host_with_several_gpus_runs_torchrun_standalone():
    resources = {"current_host": "algo-1", "hosts": ["algo-1"]}
    assert container.torchrun_command(["--steps", "5"], 1, resources) is None
    assert container.torchrun_command(["--steps", "5"], 8, resources) == [
        *container.TORCHRUN, "--nproc_per_node", "8", "--standalone", "-m", "trainer.jobs.train", "--steps", "5",
    ]


def test_a_host_without_gpus_runs_cpu_processes_data_parallel_and_a_gpu_host_one_per_gpu():
    resources = {"current_host": "algo-1", "hosts": ["algo-1"]}
    assert container.torchrun_command([], 0, resources, 1) is None
    assert container.torchrun_command(["--steps", "5"], 0, resources, 2) == [
        *container.TORCHRUN, "--nproc_per_node", "2", "--standalone", "-m", "trainer.jobs.train", "--steps", "5"]
    assert container.torchrun_command([], 8, resources, 2)[3:5] == ["--nproc_per_node", "8"]
    assert container.torchrun_command([], 1, resources, 2) is None  # one GPU: one process
    assert container.torchrun_command(["--steps", "5"], 0, resources, 2, "trainer.jobs.autoencoder")[-3:] == [
        "trainer.jobs.autoencoder", "--steps", "5"]


def test_several_hosts_run_torchrun_with_the_first_host_leading():
    resources = {"current_host": "algo-2", "hosts": ["algo-1", "algo-2", "algo-3"]}
    assert container.torchrun_command([], 8, resources) == [
        *container.TORCHRUN, "--nproc_per_node", "8", "--nnodes", "3", "--node_rank", "1",
        "--master_addr", "algo-1", "--master_port", "29500", "-m", "trainer.jobs.train",
    ]


def test_the_local_runner_can_point_the_rendezvous_at_loopback(monkeypatch):
    # the local SageMaker runs every host on 127.0.0.1 (where algo-1 does not resolve), one port per job
    monkeypatch.setenv("ATELIER_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ATELIER_MASTER_PORT", "41234")
    resources = {"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}
    assert container.torchrun_command([], 0, resources) == [
        *container.TORCHRUN, "--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "1",
        "--master_addr", "127.0.0.1", "--master_port", "41234", "-m", "trainer.jobs.train",
    ]


def test_train_writes_the_pipeline_checkpoints_and_health_output(tmp_path, shards_dir):
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir)
    result = run_container(root, "train")
    assert result.returncode == 0, result.stderr
    assert (root / "model" / "model_index.json").is_file()
    assert json.loads((root / "model" / "atelier-training.json").read_text())["steps"] == 2
    assert (root / "checkpoints" / "latest").read_text() == "step-00000002"
    assert sorted(path.name for path in (root / "output" / "data").iterdir()) == ["loss.png", "report.html", "validation"]
    assert not (root / "output" / "failure").exists()


def test_the_samconfig_demo_hyperparameters_train(tmp_path, shards_dir):
    # the local demo's training.hyperparameters (recipes/local.toml), with one step
    hyperparameters = {"steps": "1", "batch-size": "4", "resolution": "64", "learning-rate": "0.001",
                       "checkpoint-every": "20", "seed": "0", "model-config": "demo", "cpu-threads": "1"}
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, hyperparameters)
    result = run_container(root, "train")
    assert result.returncode == 0, result.stderr
    assert (root / "checkpoints" / "latest").read_text() == "step-00000001"
    assert {"event": "cpu_threads", "threads": 1} in [json.loads(line) for line in result.stdout.splitlines()
                                                      if line.startswith("{")]


def test_cpu_processes_train_one_model_data_parallel(tmp_path, shards_dir):
    # the local demo's hyperparameters with two processes of one thread: torchrun's ranks meet over gloo
    hyperparameters = {"steps": "2", "batch-size": "2", "resolution": "32", "checkpoint-every": "20", "seed": "0",
                       "model-config": "demo", "cpu-threads": "1", "cpu-processes": "2", "num-workers": "0"}
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, hyperparameters)
    result = run_container(root, "train")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {"event": "cpu_processes", "processes": 2} in events
    assert [event["world_size"] for event in events if event.get("event") == "start"] == [2]
    assert "--cpu-processes" not in container.training_argv(root)
    assert json.loads((root / "model" / "atelier-training.json").read_text())["steps"] == 2


def test_cpu_processes_train_the_autoencoder_data_parallel(tmp_path, shards_dir):
    # the local recipe's autoencoder job in two processes: each its own share of the images, rank 0 saves
    hyperparameters = {"task": "autoencoder", "steps": "2", "batch-size": "2", "resolution": "32", "model-config": "demo",
                       "aspect-buckets": "false", "random-crop": "false", "log-every": "1", "checkpoint-every": "20",
                       "num-workers": "0", "cpu-threads": "1", "cpu-processes": "2"}
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, hyperparameters)
    result = run_container(root, "train")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {"event": "cpu_processes", "processes": 2} in events
    assert [(e["task"], e["world_size"]) for e in events if e.get("event") == "start"] == [("autoencoder", 2)]
    assert [e["step"] for e in events if "psnr_db" in e and "event" not in e] == [1, 2]  # rank 0's lines alone
    record = json.loads((root / "model" / "autoencoder.json").read_text())
    assert (record["steps"], [entry["step"] for entry in record["history"]]) == (2, [1, 2])
    assert (root / "model" / "config.json").is_file() and (root / "checkpoints" / "latest").read_text() == "step-00000002"


def test_cpu_threads_caps_the_job_s_threads_and_is_the_container_s_not_the_task_s(tmp_path, monkeypatch):
    root = make_opt_ml(tmp_path / "opt-ml", None, {**HYPERPARAMETERS, "cpu-threads": "3"})
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the exports stay inside this test
    before = torch.get_num_threads()
    try:
        container.prepare_job(root)
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (3, "3")
    finally:
        torch.set_num_threads(before)
    assert "--cpu-threads" not in container.training_argv(root)


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5", "", "\u00b2"])
def test_a_bad_cpu_threads_fails_the_job_at_start_with_the_reason(tmp_path, shards_dir, monkeypatch, value):
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, {**HYPERPARAMETERS, "cpu-threads": value})
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(container.train, "main", lambda args: pytest.fail("trained despite the bad value"))
    (root / "output").mkdir()
    (root / "output" / "failure").write_text("an earlier attempt's reason\n")  # a retried job's container
    assert container.main(["train"]) == 1
    assert (root / "output" / "failure").read_text().startswith(
        f"ValueError: the hyperparameter `cpu-threads` is a whole number of threads >= 1, not {value!r}\n")


@pytest.mark.parametrize("value", ["0", "two", "1.5"])
def test_a_bad_cpu_processes_fails_the_job_at_start_with_the_reason(tmp_path, shards_dir, monkeypatch, value):
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, {**HYPERPARAMETERS, "cpu-processes": value})
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(container.train, "main", lambda args: pytest.fail("trained despite the bad value"))
    assert container.main(["train"]) == 1
    assert (root / "output" / "failure").read_text().startswith(
        f"ValueError: the hyperparameter `cpu-processes` is a whole number of processes >= 1, not {value!r}\n")


def test_a_reason_the_trainer_wrote_is_kept(tmp_path, shards_dir, monkeypatch):
    # GIVEN a trainer that writes its own failure reason, then raises
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir)
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    monkeypatch.setattr(os, "environ", dict(os.environ))

    def failing_main(args):
        (root / "output").mkdir(exist_ok=True)
        (root / "output" / "failure").write_text("NonFiniteLossError: 10 steps in a row\n")
        raise RuntimeError("secondary")

    monkeypatch.setattr(container.train, "main", failing_main)
    # WHEN the container runs it
    assert container.main(["train"]) == 1
    # THEN the trainer's reason is what SageMaker sees
    assert (root / "output" / "failure").read_text() == "NonFiniteLossError: 10 steps in a row\n"


def test_train_on_an_empty_channel_fails_with_the_reason(tmp_path):
    root = make_opt_ml(tmp_path / "opt-ml", None)
    result = run_container(root, "train")
    assert result.returncode == 1
    reason = (root / "output" / "failure").read_text()
    assert reason.startswith(f"NoShardsError: no shards (*.tar) under the training channel {root / 'input' / 'data' / 'train'}\n")


def test_an_unknown_hyperparameter_fails_with_argparse_s_message(tmp_path, shards_dir, monkeypatch):
    root = make_opt_ml(tmp_path / "opt-ml", shards_dir, {**HYPERPARAMETERS, "bogus": "1"})
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the SM_* exports stay inside this test
    assert container.main(["train"]) == 1
    assert (root / "output" / "failure").read_text().startswith("ValueError: ")
    assert "error: unrecognized arguments: --bogus 1\n" in (root / "output" / "failure").read_text()


def test_an_unknown_command_is_a_usage_error():
    assert container.main(["fit"]) == 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_ping(port: int, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)  # not listening yet, or 503 while the pipeline loads
    pytest.fail("the server never answered /ping")


def test_serve_answers_ping_and_invocations_from_the_model_dir(tmp_path, trained):
    # GIVEN a job's model directory under a fake /opt/ml
    root = tmp_path / "opt-ml"
    shutil.copytree(trained["model_dir"], root / "model")
    port = free_port()
    # WHEN the container serves it
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.container", "serve"],
        cwd=REPO_ROOT,
        env={**os.environ, "ATELIER_OPT_ML": str(root), "SAGEMAKER_BIND_TO_PORT": str(port), "SAGEMAKER_BIND_HOST": "127.0.0.1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_ping(port, process)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/invocations", body=json.dumps({"prompt": "a dog", "num_inference_steps": 1}))
        response = connection.getresponse()
        # THEN it answers with a PNG
        assert (response.status, response.getheader("Content-Type")) == (200, "image/png")
        assert response.read()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        process.terminate()
        process.wait(timeout=30)
