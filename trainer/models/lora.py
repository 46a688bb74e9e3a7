"""LoRA (`--train lora`): a pretrained base's denoiser fine-tuned through a low-rank adapter, with peft as
diffusers integrates it (`add_adapter`, `get_peft_model_state_dict`, the pipeline's `save_lora_weights`,
`load_lora_adapter`), the base's weights frozen (cast to bf16 where steps run under autocast: frozen_dtype), its
files copied byte for byte.

Only the adapter's parameters (fp32, diffusers' `cast_training_params`) are optimised, clipped, averaged
(EMA) and checkpointed; the base comes from `--pretrained` again on resume. The adapter targets the
attention projections, per family (TARGETS): the UNet's `to_q`, `to_k`, `to_v`, `to_out.0` (self- and
cross-attention, as diffusers' train_text_to_image_lora.py) and SD3's and Flux's joint attention, the image
stream's and the text stream's projections (as train_dreambooth_lora_sd3.py; Flux's single-stream blocks
match their query, key and value). PixArt has none: in diffusers 0.42
PixArtSigmaPipeline has no `load_lora_weights` and PixArtTransformer2DModel no `add_adapter`.

The model a LoRA run saves is the base's pipeline folder copied byte for byte (model_index.json and the
component folders it names), the adapter beside it as `pytorch_lora_weights.safetensors` (diffusers'
format, its LoraConfig in the file's metadata) and `atelier-lora.json` naming the base by a digest of
those files. So `DiffusionPipeline.from_pretrained(dir)` gives the base, `pipe.load_lora_weights(dir)`
adds the adapter, and the endpoint (trainer/serve/generation.py) refuses a base whose files are not the
ones the adapter was trained on.
"""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import diffusers
import torch
from diffusers import UNet2DConditionModel
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from trainer.models.bundle import Models
from trainer.objectives import numerics
from trainer.runtime.checkpoints import adapter_config, sha256_of

ADAPTER_WEIGHTS = "pytorch_lora_weights.safetensors"  # the name load_lora_weights looks for by default
ADAPTER_RECORD = "atelier-lora.json"
MODEL_INDEX = "model_index.json"
RECORD_SCHEMA = 1
TARGETS = {
    "unet": ("to_q", "to_k", "to_v", "to_out.0"),
    "sd3": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),
}
TARGETS["flux"] = TARGETS["sd3"]  # the double-stream blocks' both streams; the single-stream blocks' to_q/k/v


class LoraError(ValueError):
    """A LoRA run or adapter that cannot be: no whole base, a family without adapters, a base that changed."""


def family_name(models: Models) -> str:
    return models.family.name if models.family is not None else "unet"


def denoiser_folder(models: Models) -> str:
    """The denoiser's subfolder and its prefix in the adapter's file: `unet` or `transformer`."""
    return "transformer" if models.family is not None else "unet"


def check_run(models: Models, args) -> None:
    """What a LoRA run cannot take, refused at its start: the adapter is served on its base as the base is."""
    name = family_name(models)
    if name not in TARGETS:
        raise LoraError(f"--train lora: a {name} model has no LoRA in diffusers {diffusers.__version__} (its pipeline "
                        "has no load_lora_weights, its transformer no add_adapter); train it with --train full")
    if models.base is None or not (models.base / MODEL_INDEX).is_file():
        raise LoraError(f"--train lora needs --pretrained, a whole diffusers pipeline ({MODEL_INDEX} and its folders): "
                        f"the adapter is served on it; {args.pretrained} is not one")
    if (models.base / ADAPTER_RECORD).is_file():
        raise LoraError(f"the base {args.pretrained} holds an adapter itself ({ADAPTER_RECORD}); train on its own base")
    if not hasattr(pipeline_class(models.base), "load_lora_weights"):
        raise LoraError(f"the base {args.pretrained} is a {pipeline_class(models.base).__name__}, which cannot load "
                        "LoRA weights")
    elsewhere = sorted(part for part, source in models.sources.items()
                       if part != "scheduler" and not source.startswith("--pretrained"))
    if elsewhere:
        raise LoraError(f"--train lora: {', '.join(elsewhere)} would not come from the base "
                        f"({', '.join(models.sources[part] for part in elsewhere)}), but the adapter is served on "
                        "the base's parts (drop --vae and --init-unet random)")
    schedule = models.noise_scheduler.config if models.noise_scheduler is not None else None
    if args.zero_terminal_snr or schedule and args.prediction_type not in (None, schedule.prediction_type):
        raise LoraError("--train lora: --prediction-type and --zero-terminal-snr would train another noise schedule "
                        "than the base's, with which the adapter is served")


def frozen_dtype(device: torch.device, strategy: str, world_size: int) -> torch.dtype:
    """The dtype the frozen base's weights train in: bf16 where steps run under bf16 autocast (a GPU's), which runs
    its matmuls in bf16 anyway (half the memory: diffusers' LoRA scripts keep the base at weight_dtype); fp32 on a
    CPU, which trains without autocast, and when FSDP shards the model over several processes (one dtype a group)."""
    sharded = strategy == "fsdp" and world_size > 1
    return torch.bfloat16 if device.type in numerics.AUTOCAST_DEVICE_TYPES and not sharded else torch.float32


def adapt(models: Models, args, frozen: torch.dtype = torch.float32) -> LoraConfig | None:
    """`--train lora`: the denoiser frozen (its weights cast to `frozen`, frozen_dtype), an adapter added whose
    parameters alone train (fp32), drawn from `--seed` alike on every rank; None for `--train full`."""
    if args.train != "lora":
        return None
    check_run(models, args)
    config = config_for(family_name(models), args.lora_rank, args.lora_alpha)
    add_adapter(models.denoiser, config, args.seed, frozen)
    return config


def config_for(family: str, rank: int, alpha: int | None = None) -> LoraConfig:
    """The adapter a `family`'s denoiser gets: rank `rank`, scaled by alpha / rank (alpha the rank by default),
    lora_A drawn from a gaussian, on the family's TARGETS."""
    return LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian",
                      target_modules=list(TARGETS[family]))


def add_adapter(denoiser: torch.nn.Module, config: LoraConfig, seed: int, frozen: torch.dtype) -> None:
    """`denoiser`'s own weights frozen in `frozen`, the adapter `config` added in fp32, its draws from `seed`."""
    denoiser.requires_grad_(False)
    denoiser.to(frozen)
    torch.manual_seed(seed)  # lora_A's draws; lora_B starts at zero, so the adapted model starts as the base
    denoiser.add_adapter(config)
    cast_training_params(denoiser, torch.float32)


def base_denoiser(models: Models, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base's denoiser as it is on disk (the trained one is wrapped, maybe sharded), in `dtype`."""
    model_class = models.family.transformer_class if models.family is not None else UNet2DConditionModel
    return model_class.from_pretrained(models.base, subfolder=denoiser_folder(models), torch_dtype=dtype)


def sampling_denoiser(models: Models, weights: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """A plain copy of the base's denoiser carrying the adapter with `weights` (trained or EMA, by parameter name),
    the base in the dtype it trains in (beside it on the GPU, an fp32 copy of FLUX.1's 11.9 B would not fit)."""
    frozen = next(p.dtype for name, p in models.denoiser.named_parameters() if "lora_" not in name)
    denoiser = base_denoiser(models, frozen)
    with torch.random.fork_rng(devices=[]):  # the init draws are overwritten: the run's RNG stays where it was
        denoiser.add_adapter(copy.deepcopy(adapter_config(models.denoiser)))
    missing, unexpected = denoiser.load_state_dict(weights, strict=False)
    if unexpected or any("lora_" in name for name in missing):
        raise ValueError(f"adapter weights do not fit: unexpected {unexpected[:3]}, "
                         f"missing {[name for name in missing if 'lora_' in name][:3]}")
    return denoiser.to(device).eval()


# ---------------------------------------------------------------- the saved model: base + adapter


def pipeline_class(folder: Path) -> type:
    """The diffusers pipeline class a pipeline folder's model_index.json names."""
    name = json.loads((folder / MODEL_INDEX).read_text())["_class_name"]
    found = getattr(diffusers, name, None)
    if found is None:
        raise LoraError(f"{folder}: {MODEL_INDEX} names {name}, which diffusers {diffusers.__version__} lacks")
    return found


def pipeline_files(folder: Path) -> list[str]:
    """What DiffusionPipeline.from_pretrained reads: model_index.json and every file of the component folders it
    names, as sorted relative paths."""
    index = json.loads((folder / MODEL_INDEX).read_text())
    parts = [name for name, value in index.items()
             if not name.startswith("_") and isinstance(value, list) and value[0] is not None]
    return sorted([MODEL_INDEX, *(path.relative_to(folder).as_posix() for part in parts
                                  for path in (folder / part).rglob("*") if path.is_file())])


def base_digest(folder: Path) -> str:
    """sha256 over the lines `<path>\\t<sha256 of the file>\\n` of the pipeline's files (pipeline_files)."""
    lines = "".join(f"{name}\t{sha256_of(folder / name)[1]}\n" for name in pipeline_files(folder))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_same_base(checkpoint: Path, saved: str | None, current: str, pretrained: str) -> None:
    """A resumed LoRA run continues its adapter on the base it trained on: the base comes from --pretrained again,
    and the adapter's weights mean nothing on other base weights. A checkpoint that recorded no digest passes."""
    if saved is not None and saved != current:
        raise LoraError(f"{checkpoint} trained its adapter on a base with digest {saved}, but --pretrained {pretrained} "
                        f"has digest {current}: resume on the base it trained on, or start a new run")


def save_adapter(models: Models, weights: dict[str, torch.Tensor], model_dir: Path, pretrained: str) -> dict:
    """The base's pipeline files copied into `model_dir`, the adapter (`weights` by parameter name) beside them as
    diffusers saves it, and atelier-lora.json, which is returned (the run's record carries it too)."""
    files = pipeline_files(models.base)
    for name in files:
        (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(models.base / name, model_dir / name)
    config, folder = adapter_config(models.denoiser), denoiser_folder(models)
    layers = get_peft_model_state_dict(models.denoiser, state_dict={name: tensor.contiguous() for name, tensor
                                                                     in weights.items()})
    pipeline_class(models.base).save_lora_weights(model_dir, weight_name=ADAPTER_WEIGHTS, **{
        f"{folder}_lora_layers": layers, f"{folder}_lora_adapter_metadata": config.to_dict()})
    record = {"schema": RECORD_SCHEMA, "family": family_name(models), "pipeline": pipeline_class(models.base).__name__,
              "denoiser": folder, "weights": ADAPTER_WEIGHTS, "rank": config.r, "alpha": config.lora_alpha,
              "targets": sorted(config.target_modules),
              "base": {"pretrained": pretrained, "digest": base_digest(model_dir), "files": len(files)}}
    (model_dir / ADAPTER_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def verified_adapter(model_dir: Path) -> dict | None:
    """A model folder's atelier-lora.json (None: it holds no adapter), once its base's files are checked to be the
    ones the adapter was trained on."""
    path = Path(model_dir) / ADAPTER_RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    found = base_digest(Path(model_dir))
    if found != record["base"]["digest"]:
        raise LoraError(f"{model_dir}: the base's files have digest {found}, but the adapter was trained on "
                        f"{record['base']['pretrained']} with digest {record['base']['digest']}: refusing to serve it")
    return record


def merge_adapter(denoiser: torch.nn.Module, model_dir: Path, record: dict) -> None:
    """The folder's adapter loaded into the base's `denoiser` and merged into its weights: a plain model again,
    as fast as the base (in the precision it has now: merge before casting to bf16)."""
    denoiser.load_lora_adapter(str(model_dir), prefix=record["denoiser"], weight_name=record["weights"],
                               adapter_name="adapter")
    if "adapter" not in getattr(denoiser, "peft_config", {}):  # nothing under the prefix loads nothing, silently
        raise LoraError(f"{model_dir}: {record['weights']} holds no {record['denoiser']} adapter")
    denoiser.fuse_lora()
    denoiser.unload_lora()
