"""The image's entrypoint: `python -m trainer.container train` or `... serve`, as SageMaker runs it.

`train` reads the job's configuration from <root>/input/config/, exports the SM_* variables the
SageMaker training toolkit would (a custom image has no toolkit) and the NCCL/EFA ones it would set
for torchrun (trainer/runtime/cluster.py; a variable the job's Environment set is kept), and runs
trainer.jobs.train: in this process on one host with a CPU or one GPU, otherwise under torchrun with one
process per GPU (and, with several hosts, the first host leading the rendezvous). A failure's reason goes to
<root>/output/failure (SageMaker's FailureReason is its first 1,024 characters; a reason the
trainer wrote there itself is kept) and the exit status is 1. With the hyperparameter `task=evaluate`
(absent or `train`: training), `train` runs trainer.jobs.evaluate instead, in this process, with the other
hyperparameters as its arguments: a SageMaker training job that scores a candidate model and writes
<root>/model/evaluation.json. With `task=encode`, trainer.jobs.encode turns the `train` channel's image
shards into latent shards under <root>/checkpoints/latents/ (CheckpointConfig uploads them to S3). With
`task=autoencoder`, trainer.jobs.autoencoder trains the lineage's VAE from scratch into <root>/model (in one
process or under torchrun, as training is); with
`task=tokenizer`, trainer.jobs.tokenizer learns the lineage's caption tokenizers into <root>/model. `serve` answers /ping and /invocations with the pipeline in <root>/model.

The hyperparameter `cpu-threads=N`, for any task, caps the job's CPU threads (torch's and OpenMP's) at N;
absent, torch takes every core. A fixed count gives the same arithmetic on any number of cores of one
instruction set; threads beyond the free cores wait on each other (bench/cpu_threads.py --busy).
`cpu-processes=P` (the `train` and `autoencoder` tasks, a host without GPUs) trains data-parallel in P processes under torchrun
(gloo), each of `cpu-threads` threads and `batch-size` pictures a step: they meet once a step, not at every
operation as threads do, so a busy core slows them by its share instead of stalling them
(bench/cpu_processes.py). On a host with GPUs it is ignored (one process per GPU), and says so in the log.

<root> is /opt/ml unless $ATELIER_OPT_ML names another (the local stack gives each job its own).
With several hosts, $ATELIER_MASTER_ADDR and $ATELIER_MASTER_PORT, when set, replace the first host's
name and port 29500 for the rendezvous: the local runner emulates every host on 127.0.0.1, where
`algo-1` does not resolve, and gives each job its own port.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from contracts import recipe, s3_layout
from trainer.jobs import autoencoder, encode, evaluate, tokenizer, train
from trainer.runtime import cluster
from trainer.serve import server as serve

PACKAGE_PARENT = Path(__file__).resolve().parent.parent  # so torchrun's workers import `trainer`
MASTER_PORT = 29500
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, wherever this Python's scripts are not on PATH
TASKS = recipe.TASKS  # the `task` hyperparameter
CONTAINER_HYPERPARAMETERS = recipe.CONTAINER_HYPERPARAMETERS  # the container's own, not the task's arguments


def opt_ml() -> Path:
    return Path(os.environ.get("ATELIER_OPT_ML", "/opt/ml"))


def read_json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


def hyperparameters(root: Path) -> dict[str, str]:
    """hyperparameters.json: the job's HyperParameters, all strings ({} without it)."""
    return read_json(root / "input" / "config" / "hyperparameters.json", {})


def resource_config(root: Path) -> dict:
    """resourceconfig.json: this host, every host, the network interface, the instance type (one host without it)."""
    return read_json(root / "input" / "config" / "resourceconfig.json", {"current_host": "algo-1", "hosts": ["algo-1"]})


def sagemaker_environment(root: Path) -> dict[str, str]:
    """The SM_* variables for the job configured under `root`, as the training toolkit sets them."""
    config = root / "input" / "config"
    channels = sorted(read_json(config / "inputdataconfig.json", {}))
    resources = resource_config(root)
    environment = {
        "SM_MODEL_DIR": str(root / "model"),
        "SM_OUTPUT_DIR": str(root / "output"),
        "SM_OUTPUT_DATA_DIR": str(root / "output" / "data"),
        "SM_CHANNELS": json.dumps(channels),
        "SM_HPS": json.dumps(hyperparameters(root)),
        "SM_HOSTS": json.dumps(resources["hosts"]),
        "SM_CURRENT_HOST": resources["current_host"],
        "SM_NUM_GPUS": str(torch.cuda.device_count()),
    }
    for channel in channels:
        environment[f"SM_CHANNEL_{channel.upper()}"] = str(root / "input" / "data" / channel)
    return environment


def job_task(root: Path) -> str:
    """The `task` hyperparameter: `train` (also when absent), `evaluate`, `encode`, `autoencoder` or `tokenizer`."""
    task = hyperparameters(root).get(recipe.TASK, "train")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: the hyperparameter `task` is one of {', '.join(TASKS)}")
    return task


def cpu_threads(root: Path) -> int | None:
    """The `cpu-threads` hyperparameter: a whole number >= 1, or None when absent."""
    return recipe.cpu_threads(hyperparameters(root).get(recipe.CPU_THREADS))


def cpu_processes(root: Path) -> int | None:
    """The `cpu-processes` hyperparameter: a whole number >= 1, or None when absent."""
    return recipe.cpu_processes(hyperparameters(root).get(recipe.CPU_PROCESSES))


def hyperparameter_argv(root: Path) -> list[str]:
    """The hyperparameters (all strings) as `--name value`, without the container's and the SageMaker SDK's own."""
    argv = []
    for name, value in hyperparameters(root).items():
        if name not in CONTAINER_HYPERPARAMETERS and not name.startswith("sagemaker_"):  # the SDK's own settings
            argv += [f"--{name}", str(value)]
    return argv


def training_argv(root: Path) -> list[str]:
    """The hyperparameters as `--name value`, plus the checkpoint directory."""
    return hyperparameter_argv(root) + ["--checkpoint-dir", str(root / "checkpoints")]


def parse_quietly(parse, argv: list[str]):
    """parse(argv), with a rejected argument raised as an error that carries argparse's message."""
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            return parse(argv)
    except SystemExit:
        raise ValueError(messages.getvalue().strip().splitlines()[-1]) from None


def parse_training_args(argv: list[str]):
    return parse_quietly(train.parse_args, argv)


def torchrun_command(argv: list[str], gpus: int, resources: dict, cpu_processes: int | None = None,
                     module: str = "trainer.jobs.train") -> list[str] | None:
    """torchrun of `module` over every GPU of every host (a host without GPUs: `cpu_processes`, default 1), or
    None when one process does (0 or 1 GPU, one host)."""
    hosts = resources["hosts"]
    per_host = gpus if gpus >= 1 else (cpu_processes or 1)
    if per_host <= 1 and len(hosts) <= 1:
        return None
    command = [*TORCHRUN, "--nproc_per_node", str(per_host)]
    if len(hosts) == 1:
        command.append("--standalone")
    else:  # SageMaker names hosts algo-1..algo-N and resolves them; the first one leads the rendezvous
        command += ["--nnodes", str(len(hosts)), "--node_rank", str(hosts.index(resources["current_host"])),
                    "--master_addr", os.environ.get("ATELIER_MASTER_ADDR", hosts[0]),
                    "--master_port", os.environ.get("ATELIER_MASTER_PORT", str(MASTER_PORT))]
    return command + ["-m", module, *argv]


def prepare_job(root: Path) -> None:
    """The SM_* and the NCCL/EFA variables exported, the CPU threads capped, the model dir made, a
    previous run's failure reason gone."""
    os.environ.update(sagemaker_environment(root))
    os.environ.update(cluster.network_environment(resource_config(root), os.environ, cluster.network_interfaces()))
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "output" / "failure").unlink(missing_ok=True)  # a reason written now is this run's
    cpu_processes(root)  # a bad value fails the job here, whatever its task
    if (threads := cpu_threads(root)) is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # torchrun's workers and any other process the task starts
        print(json.dumps({"event": "cpu_threads", "threads": threads}), flush=True)


def run_job(root: Path) -> None:
    """What `train` runs: the job's task."""
    prepare_job(root)
    task = job_task(root)
    if task == "evaluate":
        evaluate.main(parse_quietly(evaluate.parse_args, hyperparameter_argv(root)))
    elif task == "encode":  # latent shards go where CheckpointConfig uploads them (trainer/jobs/encode.py)
        argv = ["--output-dir", str(root / "checkpoints" / s3_layout.LATENTS.rstrip("/")), *hyperparameter_argv(root)]
        encode.main(parse_quietly(encode.parse_args, argv))
    elif task == "autoencoder":
        run_data_parallel(root, autoencoder)
    elif task == "tokenizer":
        tokenizer.main(parse_quietly(tokenizer.parse_args, hyperparameter_argv(root)))
    else:
        run_data_parallel(root, train)


def run_data_parallel(root: Path, job) -> None:
    """A data-parallel job module (trainer.jobs.train, trainer.jobs.autoencoder) with the job's hyperparameters:
    in this process, or under torchrun."""
    argv = training_argv(root)
    args = parse_quietly(job.parse_args, argv)  # here, so a bad hyperparameter fails before torchrun
    resources = resource_config(root)
    gpus, processes = torch.cuda.device_count(), cpu_processes(root)
    if processes is not None:
        print(json.dumps({"event": "cpu_processes", "processes": processes if not gpus else None,
                          **({"ignored": f"{gpus} GPUs: one process per GPU"} if gpus else {})}), flush=True)
    command = torchrun_command(argv, gpus, resources, processes, job.__name__)
    if command is None:
        job.main(args)
        return
    python_path = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))
    status = subprocess.run(command, env={**os.environ, "PYTHONPATH": python_path}).returncode
    if status != 0:
        raise RuntimeError(f"torchrun exited with status {status}; the job log holds each rank's traceback")


def write_failure(root: Path, error: BaseException) -> None:
    """The reason first (SageMaker keeps 1,024 characters), then the traceback for the log reader."""
    failure = root / "output" / "failure"
    if failure.is_file():  # the trainer wrote the reason itself (e.g. repeated non-finite losses): keep it
        return
    failure.parent.mkdir(parents=True, exist_ok=True)
    details = "".join(traceback.format_exception(error))
    failure.write_text(f"{type(error).__name__}: {error}\n\n{details}")


def main(argv: list[str]) -> int:
    root = opt_ml()
    command = argv[0] if argv else ""
    if command == "train":
        try:
            run_job(root)
        except Exception as error:
            write_failure(root, error)
            traceback.print_exc()
            return 1
        return 0
    if command == "serve":
        serve.main(root / "model")
        return 0
    print("usage: python -m trainer.container train|serve", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
