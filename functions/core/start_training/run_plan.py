"""The run plan: the training jobs each manifest of a lineage goes through, and what is checked of them
before any job is paid for (the start-training function's settings parse it; core.start_training.job_requests
turns each into a request)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from contracts import model_presets
from contracts.recipe import auto_or_flag
from contracts.recipe_jobs import AutoencoderOptions
from core.errors import ConfigError
from core.settings import flat_strings
from core.start_training.instance_types import GPUS_PER_INSTANCE, has_cuda

# CreateTrainingJob's HyperParameters (botocore's model): 100 entries, keys of 256 and values of 2,500
# characters, each matching `.*`, which (in Java, as in Python) takes no line break
MAX_HYPERPARAMETERS, MAX_HYPERPARAMETER_KEY, MAX_HYPERPARAMETER_VALUE = 100, 256, 2500
LINE_BREAKS = ("\n", "\r", "\u0085", "\u2028", "\u2029")


@dataclass(frozen=True)
class PlannedJob:
    """One job of a run plan: its instances and the hyperparameters it overrides."""

    name: str
    instance_type: str
    instance_count: int
    hyperparameters: dict[str, str]

    @property
    def steps(self) -> int:
        return int(self.hyperparameters.get("steps", "0"))


def hyperparameters(values: dict[str, str], name: str) -> dict[str, str]:
    """SageMaker hyperparameters within CreateTrainingJob's limits, checked when the function starts rather
    than when a job is refused."""
    if len(values) > MAX_HYPERPARAMETERS:
        raise ValueError(f"{name} has {len(values)} entries; SageMaker takes at most {MAX_HYPERPARAMETERS}")
    for key, value in values.items():
        if len(key) > MAX_HYPERPARAMETER_KEY or len(value) > MAX_HYPERPARAMETER_VALUE:
            raise ValueError(f"{name}: {key[:40]!r} is over SageMaker's {MAX_HYPERPARAMETER_KEY} characters a name "
                             f"or {MAX_HYPERPARAMETER_VALUE} a value")
        if any(mark in key + value for mark in LINE_BREAKS):
            raise ValueError(f"{name}: {key[:40]!r} holds a line break, which SageMaker refuses in a hyperparameter")
    return values


def parse_run_plan(raw: str, base: dict[str, str], default: PlannedJob,
                   name: str = "TRAINING_RUN_PLAN") -> tuple[PlannedJob, ...]:
    """TRAINING_RUN_PLAN (the recipe's training.run_plan, `name` in messages):
    `[{"name", "instance_type"?, "instance_count"?, "hyperparameters"?}, ...]`; empty: one job with the base
    instance settings."""
    try:
        plan: Any = json.loads(raw or "[]")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None
    if not isinstance(plan, list):
        raise ValueError(f"{name} must be a JSON list of jobs")
    if not plan:
        return (PlannedJob(default.name, default.instance_type, default.instance_count, dict(base)),)
    jobs = []
    for index, item in enumerate(plan):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"{name}[{index}] needs a name")
        where = f"{name}[{index}].hyperparameters"
        overrides = hyperparameters(flat_strings(json.dumps(item.get("hyperparameters", {})), where), where)
        count = item.get("instance_count", default.instance_count)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"{name}[{index}].instance_count must be a whole number >= 1")
        jobs.append(PlannedJob(item["name"], str(item.get("instance_type", default.instance_type)), count,
                               {**base, **overrides}))
    return tuple(jobs)


def check_encodable(job: PlannedJob) -> None:
    """Latent shards hold one centred crop per sample at the job's resolution (trainer/jobs/encode.py):
    a job they cannot serve is refused here, when the function starts, before any encode job is paid for
    (a job's run-config, several resolutions in one job, contracts.recipe refuses for every job)."""
    if job.hyperparameters.get("random-crop", "false").lower() in {"true", "1", "yes"}:
        raise ConfigError(f"run-plan job {job.name!r} asks for random-crop, which needs image shards: "
                          "set TRAINING_ENCODE_INSTANCE_TYPE (EncodeInstanceType) empty or drop random-crop")


def check_cuda_graphs(job: PlannedJob, gpus_override: int) -> None:
    """`cuda-graphs true` runs a single process on an NVIDIA GPU (the gradient all-reduce is not captured):
    refused for a job of several instances or GPUs, or on a type without CUDA, as the trainer would refuse it at
    its start (`auto` turns them off there). TRAINING_GPUS_PER_INSTANCE, when set, vouches for the GPUs."""
    if auto_or_flag(job.hyperparameters.get("cuda-graphs", "auto")) is not True:
        return
    if not gpus_override and not has_cuda(job.instance_type):
        raise ConfigError(f"run-plan job {job.name!r}: cuda-graphs true needs a CUDA device, and {job.instance_type} "
                          "has no NVIDIA GPU; set cuda-graphs auto or false")
    processes = job.instance_count * (gpus_override or GPUS_PER_INSTANCE.get(job.instance_type, 1))
    if processes > 1:
        raise ConfigError(f"run-plan job {job.name!r}: cuda-graphs true runs in a single process, and this job runs "
                          f"{processes} ({job.instance_count} x {job.instance_type}); set cuda-graphs auto or false")


def check_sharding(quota: int, job: PlannedJob, gpus_override: int) -> None:
    """ShardedByS3Key gives each instance quota/instances shards; each of its GPUs reads whole
    shards, so it needs at least one, and the same number as its neighbours. The loader's workers
    share a GPU's batches, not its shards (trainer/data/shards.py, loader.py), so they need no shards of their own."""
    gpus = gpus_override or GPUS_PER_INSTANCE.get(job.instance_type, 1)
    if quota % job.instance_count:
        raise ConfigError(f"run-plan job {job.name}: a quota of {quota} shards does not split evenly over "
                          f"{job.instance_count} instances")
    per_instance = quota // job.instance_count
    if per_instance < gpus:
        raise ConfigError(f"run-plan job {job.name}: {per_instance} shards per instance for {gpus} GPUs; "
                          f"raise TrainingQuota to at least {job.instance_count * gpus}")
    if per_instance % gpus:
        raise ConfigError(f"run-plan job {job.name}: {per_instance} shards per instance do not split evenly over "
                          f"{gpus} GPUs; use a multiple of {job.instance_count * gpus}")


def check_autoencoder_resolution(job: PlannedJob, autoencoder: dict[str, str]) -> None:
    """The autoencoder job's resolution, as its request merges it (the run-plan job's options it takes, then the
    recipe's autoencoder hyperparameters), is a multiple of its preset's VAE downsampling, which the job refuses
    at its start otherwise (the training job's own resolution is checked with the denoiser's multiple)."""
    taken = AutoencoderOptions.training_job_flags()
    merged = {**{k: v for k, v in job.hyperparameters.items() if k in taken}, **autoencoder}
    if refusal := model_presets.resolution_refusal(merged, model_presets.VAE_DOWNSAMPLING, "its VAE's downsampling"):
        raise ConfigError(f"run-plan job {job.name!r}'s autoencoder job: {refusal}")
