"""The training recipe: every option a training job takes, typed once, on both sides of the boundary.

`TrainOptions` is trainer.jobs.train's options: each field a flag (its alias, the kebab-case name that is
also the SageMaker hyperparameter's), with its type, default, choices and help. The trainer builds its
argparse parser from it and checks the parsed values with it (trainer/jobs/train_args.py); the
start-training function checks every run-plan job's hyperparameters with the same model when it starts
(`refusal`, core/settings.py), so a value the trainer would refuse fails before any job is paid for.
`Phase` is one phase of a run config (trainer/configs/runs/, trainer/data/phases.py). The encode and
autoencoder jobs' options are in contracts.recipe_jobs; the container's own hyperparameters are here.

Not recipe fields: the container paths (TRAIN_PATHS), which come from the SM_* environment or the
container, never from a recipe. tests/trainer/test_recipe.py fails when a flag has no field or the reverse.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from contracts import model_presets

# The container's own hyperparameters (trainer/container.py), never a job's arguments; a run-plan job's encode
# and autoencoder jobs take its `cpu-threads` too (core/start_training/job_requests.py); `cpu-processes` is the
# training task's alone (data-parallel processes on a host without GPUs).
TASK, CPU_THREADS, CPU_PROCESSES = "task", "cpu-threads", "cpu-processes"
RUN_CONFIG = "run-config"  # trainer.jobs.train's phases preset: a run by hand (the pipeline plans with run_plan)
TASKS = ("train", "evaluate", "encode", "autoencoder", "tokenizer")  # the values of `task`
CONTAINER_HYPERPARAMETERS = (TASK, CPU_THREADS, CPU_PROCESSES)
PLANNED_JOB_CONTAINER_HYPERPARAMETERS = (CPU_THREADS,)
# trainer.jobs.train's flags that name where the container put things (the SM_* environment, the container's
# --checkpoint-dir): declared here so that they are known not to be recipe fields
TRAIN_PATHS = ("train-dir", "model-dir", "output-data-dir", "checkpoint-dir", "index-dir", "manifest")
DEFAULT_VALIDATION_PROMPTS = ("a red dog on the beach|a photo of a city street at night|a bowl of fruit on a table"
                              "|a mountain lake at sunrise")


def flag(value: Any) -> bool:
    """A boolean hyperparameter: SageMaker passes `true`/`false` (any case; also 1/0, yes/no) as a string."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def auto_or_flag(value: Any) -> bool | str:
    """`auto` (the job decides by itself), or a boolean."""
    return "auto" if isinstance(value, str) and value.lower() == "auto" else flag(value)


def _count(raw: Any, name: str, unit: str) -> int | None:
    """A container hyperparameter that counts something: a whole number >= 1, or None when absent."""
    if raw is None:
        return None
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"the hyperparameter `{name}` is a whole number of {unit} >= 1, not {raw!r}")
    return int(text)


def cpu_threads(raw: Any) -> int | None:
    """The `cpu-threads` hyperparameter: a whole number >= 1, or None when absent."""
    return _count(raw, CPU_THREADS, "threads")


def cpu_processes(raw: Any) -> int | None:
    """The `cpu-processes` hyperparameter: a whole number >= 1, or None when absent."""
    return _count(raw, CPU_PROCESSES, "processes")


Flag = Annotated[bool, BeforeValidator(flag)]
AutoFlag = Annotated[bool | Literal["auto"], BeforeValidator(auto_or_flag)]


def option(default: Any, help: str, group: str | None = None, *, from_training_job: bool = False, flag: str | None = None,
           also: tuple[str, ...] = ()) -> Any:
    """A recipe field: its default, its help (argparse's, and the docs'), the argparse group it is listed in,
    (an encode or autoencoder job's) whether it is taken from the training job it serves, its flag where
    that is not the field's name in kebab case, and other names it is also given by (recipes written before)."""
    extra = {key: value for key, value in (("group", group), ("from_training_job", from_training_job), ("also", also))
             if value}
    return Field(default, alias=flag, description=help, json_schema_extra=extra or None)


def also_names(field: Any) -> tuple[str, ...]:
    return tuple((field.json_schema_extra or {}).get("also", ()))


def dest(field: Any) -> str:
    """The argparse attribute of a field's flag (`--model-config`: `model_config`, a name pydantic keeps)."""
    return field.alias.replace("-", "_")


class Options(BaseModel):
    """A job's options: validated by field name from argparse, by alias (the flag) from hyperparameters."""

    task: ClassVar[str]  # the container's `task` that runs the job (TASKS)
    model_config = ConfigDict(alias_generator=lambda name: name.replace("_", "-"), validate_by_name=True,
                              validate_by_alias=True, extra="forbid", frozen=True)

    @classmethod
    def flags(cls) -> set[str]:
        return {name for field in cls.model_fields.values() for name in (field.alias, *also_names(field))}

    @model_validator(mode="before")
    @classmethod
    def _other_names(cls, data: Any) -> Any:
        """A field given by another of its names (`also`) is read as given by its flag; both at once is refused."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for field in cls.model_fields.values():
            for other in also_names(field):
                if other in data:
                    if field.alias in data:
                        raise ValueError(f"{other} and {field.alias} name one option: give one of them")
                    data[field.alias] = data.pop(other)
        return data

    @classmethod
    def training_job_flags(cls) -> tuple[str, ...]:
        """The flags a helper job takes from its training job's hyperparameters."""
        return tuple(f.alias for f in cls.model_fields.values() if (f.json_schema_extra or {}).get("from_training_job"))


WHERE, MODEL, RUN, SYSTEM, DATA, HEALTH = ("where", "model", "run (a single phase unless --run-config)", "system",
                                           "data", "checkpoints and health")


class TrainOptions(Options):
    """trainer.jobs.train's options (docs/trainer.md, "Arguments")."""

    task: ClassVar[str] = "train"
    resume: str = option("latest", "'latest' (the newest complete checkpoint, if any), 'none', or a checkpoint directory", WHERE)
    preset: str = option(model_presets.DEFAULT, "a preset in trainer/configs/ (without .json)", MODEL,
                         flag="model-config")
    pretrained: str | None = option(None, "a diffusers pipeline, or some of its subfolders (vae, text_encoder + "
                                    "tokenizer, scheduler, unet): a directory, a channel name or a model.tar.gz; what "
                                    "it lacks comes from --model-config", MODEL)
    vae: str | None = option(None, "an AutoencoderKL (the autoencoder job's model: a directory, channel or "
                             "model.tar.gz); replaces the base's", MODEL)
    tokenizer: str | None = option(None, "the pipeline's tokenizer subfolders for text encoders the base does not "
                                   "bring (a tokenizer job's model: a directory, channel or model.tar.gz); without it "
                                   "they are learned from the training shards' captions at start "
                                   "(trainer/models/text_tokenizers.py)", MODEL)
    init_unet: Literal["pretrained", "random"] | None = option(
        None, "fine-tune the base's UNet, or train one from scratch on its frozen parts (default: the base's UNet "
        "when it has one)", MODEL)
    train: Literal["full", "lora"] = option("full", "full: every weight of the denoiser trains; lora: a low-rank "
                                            "adapter on the --pretrained base's attention projections alone, saved "
                                            "beside the base (trainer/models/lora.py)", MODEL)
    lora_rank: int = option(4, "the adapter's rank (--train lora)", MODEL)
    lora_alpha: int | None = option(None, "the adapter's alpha: its update is scaled by alpha / rank (default: the rank)", MODEL)
    prediction_type: Literal["epsilon", "v_prediction"] | None = option(
        None, "the UNet's target (default: the scheduler's)", MODEL)
    zero_terminal_snr: Flag = option(False, "rescale the noise schedule to reach pure noise at its last step "
                                     "(needs v_prediction)", MODEL)
    noise_offset: float = option(0.0, "offset noise strength (0: off; 0.05 is common)", MODEL)
    snr_gamma: float | None = option(None, "min-SNR loss weighting with this gamma (5 is common; default off)", MODEL)
    ema_decay: float = option(0.9999, "EMA of the UNet weights (0: no EMA)", MODEL)
    final_weights: Literal["ema", "trained"] = option("ema", "what the saved pipeline holds", MODEL)

    run_config: str | None = option(None, "phases preset in trainer/configs/runs/, or a .json path", RUN)
    steps: int | None = option(None, "the run's last step, counting resumed ones (default 1000)", RUN)
    first_step: int = option(1, "the run's first step; warm-up and cosine count from it", RUN)
    batch_size: int | None = option(None, "images per micro-batch per process (default 4)", RUN)
    resolution: int | None = option(None, "bucket area as a square side (default: the model's)", RUN)
    learning_rate: float | None = option(None, "AdamW's, after warm-up (default 1e-4)", RUN)
    lr_warmup_steps: int = option(0, "linear warm-up of a single-phase run", RUN)
    lr_final_fraction: float = option(1.0, "below 1: a cosine from the warm-up's end down to this share of the "
                                      "rate (single phase)", RUN)
    gradient_accumulation: int = option(1, "micro-batches per optimizer step", RUN)
    max_grad_norm: float = option(1.0, "gradient clipping (inf: measure only)", RUN)
    seed: int = option(0, "model init, data order, noise", RUN)

    strategy: Literal["ddp", "fsdp"] = option("ddp", "how several processes share the UNet", SYSTEM)
    gradient_checkpointing: Flag = option(False, "recompute activations: less memory, ~30% more time", SYSTEM)
    num_workers: int = option(2, "DataLoader processes per training process", SYSTEM)
    compile: AutoFlag = option("auto", "torch.compile the UNet step (and on image shards the VAE encoder), or a "
                               "transformer family's blocks in place: true, "
                               "false, or auto (on a GPU where configs/defaults/fast.json measured it faster for the "
                               "preset and resolution). Minutes of compiling per shape unless --compile-cache holds it",
                               SYSTEM)
    compile_cache: str | None = option(None, "directory of compiled-shape files, read at start and written after "
                                       "each phase's first step (default <checkpoint-dir>/compile-cache; also read: "
                                       "$SM_CHANNEL_COMPILE_CACHE; 'none': off)", SYSTEM)
    cuda_graphs: AutoFlag = option("auto", "replay the UNet's forward and backward from a CUDA graph per shape "
                                   "(trainer/speed/cuda_graphs.py; one process on a GPU): true, false, or auto (where "
                                   "configs/defaults/fast.json measured it faster for the preset and resolution)", SYSTEM)
    fused_adamw: Flag = option(True, "fused AdamW kernels on a GPU (DDP or one process)", SYSTEM)
    channels_last: Flag = option(False, "channels-last UNet weights (measured slower eager)", SYSTEM)

    aspect_buckets: Flag = option(True, "batch by aspect ratio (else centre squares)", DATA)
    random_crop: Flag = option(False, "random crops inside the bucket (else centred)", DATA)
    caption_dropout: float = option(0.1, "share of captions replaced by '' so guidance has an unconditional model "
                                    "to contrast with", DATA)

    checkpoint_every: int = option(500, "also at the last step", HEALTH)
    keep_checkpoints: int = option(2, "the newest K step directories are kept", HEALTH)
    async_checkpoints: Flag = option(True, "write each checkpoint in a thread while training goes on (its state "
                                     "copied to the host first; trainer/runtime/checkpoint_writer.py), else in place",
                                     HEALTH)
    log_every: int = option(10, "also at the last step", HEALTH)
    tensorboard_dir: str | None = option(None, "TensorBoard event files (default $SM_OUTPUT_DIR/tensorboard, else "
                                         "<health dir>/tensorboard; 'none': off)", HEALTH)
    max_nonfinite_steps: int = option(10, "non-finite steps in a row that end the job", HEALTH)
    watchdog_minutes: float = option(30, "no optimizer step for this long (before the first: twice as long) dumps "
                                     "every thread's stack, writes the failure reason and ends the job (0: off)", HEALTH)
    preflight_timeout: float = option(120, "seconds the start-up all-reduce over all ranks may take (it connects "
                                      "them too)", HEALTH)
    preflight_min_free_fraction: float = option(0.8, "share of each GPU's memory that must be free at start", HEALTH)
    validation_prompts: str = option(DEFAULT_VALIDATION_PROMPTS, "'|'-separated; '' for none", HEALTH)
    validation_seeds: str = option("0", "comma-separated; one grid column each", HEALTH)
    validation_inference_steps: int | None = option(None, "DDIM steps per grid (default 20 on a GPU; 4 on a CPU, "
                                                    "where the grid is a smoke check)", HEALTH)

    @model_validator(mode="after")
    def _checks(self) -> "TrainOptions":
        # The checks that fail a job before it starts, in this order, each with the message a job's log shows.
        if self.seed < 0 or self.gradient_accumulation < 1 or self.keep_checkpoints < 1:
            raise ValueError("--seed must be >= 0, --gradient-accumulation and --keep-checkpoints >= 1")
        if self.watchdog_minutes < 0 or self.preflight_timeout <= 0 or not 0 <= self.preflight_min_free_fraction <= 1:
            raise ValueError("--watchdog-minutes must be >= 0, --preflight-timeout > 0, --preflight-min-free-fraction "
                             "in 0..1")
        if self.train == "lora" and not self.pretrained:
            raise ValueError("--train lora needs --pretrained: a LoRA adapts a pretrained base (a whole diffusers "
                             "pipeline), with which it is served")
        if self.lora_rank < 1 or self.lora_alpha is not None and self.lora_alpha < 1:
            raise ValueError("--lora-rank and --lora-alpha must be >= 1")
        family = model_presets.FAMILIES.get(self.preset)
        if family and not self.pretrained:  # the preset's family trains (a base brings its own: checked as it loads)
            if refusal := (model_presets.flow_refusal(family, self.prediction_type, self.zero_terminal_snr,
                                                      self.snr_gamma, self.noise_offset)
                           or model_presets.position_refusal(self.preset, self.resolution, self.aspect_buckets)
                           or model_presets.schedule_refusal(self.preset, self.prediction_type, self.zero_terminal_snr)):
                raise ValueError(refusal)
        return self


class Phase(BaseModel):
    """One phase of a run config (`{"phases": [...]}` in trainer/configs/runs/): its resolution, batch size,
    learning rate and steps; the learning rate warms up over `warmup_steps`, then with `final_lr_fraction`
    below 1 follows a cosine down to that share of itself (trainer/data/phases.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    resolution: int  # the bucket area as a square side; a multiple of the models' size multiple (checked where they load)
    batch_size: int  # images per micro-batch per process
    learning_rate: float
    steps: int
    warmup_steps: int = 0
    final_lr_fraction: float = 1.0  # 1: constant after warm-up

    @model_validator(mode="after")
    def _positive(self) -> "Phase":
        if min(self.resolution, self.batch_size, self.steps) <= 0 or self.learning_rate <= 0:
            raise ValueError("resolution, batch_size, steps and learning_rate must be positive")
        if not 0 < self.final_lr_fraction <= 1:
            raise ValueError(f"final_lr_fraction must lie in (0, 1], got {self.final_lr_fraction}")
        return self


def first_error(error: ValidationError) -> str:
    """A validation error as one line: a field's, named by its flag, or a check's own message."""
    first = error.errors()[0]
    message = str(first["ctx"]["error"]) if "error" in first.get("ctx", {}) else first["msg"]  # a check's, as written
    if not first["loc"]:  # a check of several fields
        return message
    name = ".".join(str(part) for part in first["loc"])
    return f"{name}: {message}" if first["type"] == "missing" else f"{name} {first['input']!r}: {message}"


def unknown_refusal(names: Iterable[str], options: type[Options] = TrainOptions) -> str | None:
    """Why a job refuses hyperparameters by these names: any that is none of its flags, the container's own,
    a container path, or the SageMaker SDK's (`sagemaker_*`); None if there is none (a typo is never ignored)."""
    unknown = sorted(name for name in names if name not in options.flags() and not name.startswith("sagemaker_")
                     and name not in (*CONTAINER_HYPERPARAMETERS, *TRAIN_PATHS))
    if not unknown:
        return None
    near = difflib.get_close_matches(unknown[0], sorted(options.flags()), n=1)
    return (f"hyperparameter {unknown[0]!r} is not an option of the job" + (f" (did you mean {near[0]!r}?)" if near else "")
            + (f"; nor are {', '.join(map(repr, unknown[1:]))}" if len(unknown) > 1 else ""))


def refusal(hyperparameters: Mapping[str, str], options: type[Options] = TrainOptions,
            added: Mapping[str, str] | None = None) -> str | None:
    """Why a job with these (SageMaker, string) hyperparameters would refuse to start; None if it would not.
    Each of `options`' flags is parsed as the job parses it, and the container's `cpu-threads` and
    `cpu-processes`; `added` are the hyperparameters the job request adds (the `pretrained` channel). A name
    that is none of the job's flags is refused as the job's parser would refuse it (the SageMaker SDK's own
    `sagemaker_*` names aside)."""
    if unknown := unknown_refusal(hyperparameters, options):
        return unknown
    if pipelines := sorted(name for name in hyperparameters
                           if name in TRAIN_PATHS or name == TASK and hyperparameters[name] != options.task):
        # the job's task and where its container puts the files are the pipeline's (a recipe's `manifest` would
        # point the job away from the manifest channel, and its licensing and takedown exclusions with it)
        return (f"hyperparameter {pipelines[0]!r} is the pipeline's to set (the job's task, {options.task!r} here, and where "
                "the container puts its files): a recipe cannot set it")
    if options is TrainOptions and RUN_CONFIG in hyperparameters:
        return (f"{RUN_CONFIG}: the pipeline sets each job's steps and plans a lineage's phases with training.run_plan "
                f"(one job a phase); {RUN_CONFIG} is for running the trainer by hand")
    known = {name: value for name, value in {**hyperparameters, **(added or {})}.items() if name in options.flags()}
    try:
        options.model_validate(known)
        cpu_threads(hyperparameters.get(CPU_THREADS))
        cpu_processes(hyperparameters.get(CPU_PROCESSES))
    except ValidationError as error:
        return first_error(error)
    except ValueError as error:
        return str(error)
    return None
