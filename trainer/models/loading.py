"""Where a run's models come from: a preset in `configs/` (fresh weights from a seed) or a local
diffusers pipeline (a base, or some of its parts, and a separate VAE), checked to fit together.
"""

import atexit
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from contracts.s3_layout import MODEL_ARCHIVE
from trainer.models.bundle import CPU, Models
from trainer.models import families, lora, text_tokenizers
from trainer.models.families import Family, preset_source
from trainer.objectives.flow_matching import FlowSettings

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


class BaseModelError(ValueError):
    """A `--pretrained` base or `--vae` that cannot be used: missing, malformed or not matching the rest."""


COMPONENTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
              "unet", "transformer", "scheduler")


def load_models(model_config: str, pretrained: str | None, seed: int, vae: str | None = None,
                init_unet: str | None = None, device: torch.device = CPU, tokenizer: str | None = None,
                captions: Callable[[], Iterable[str]] | None = None, text_encoders: bool = True) -> Models:
    """The run's models: each component from `pretrained` (a pipeline, or some of its subfolders) where
    it has one, the VAE from `vae` when given, the rest built from the preset `model_config` with `seed`.

    `init_unet`: `pretrained` fine-tunes the base's UNet, `random` trains one from scratch on the base's
    frozen parts (how a licensed-only model is trained); the default takes the base's UNet if it has one.
    The UNet is on `device`, the one that trains it (from_preset); the frozen parts stay on the CPU
    until `Models.frozen_to`. Everything is checked to fit together before any data is read: a bad base
    fails the job at start.

    Text encoders the base does not bring are built with the tokenizers of `tokenizer` (a folder or
    channel holding the pipeline's tokenizer subfolders: a tokenizer job's output), else with tokenizers
    learned from `captions()` (trainer/models/text_tokenizers.py), which is only called then.

    `text_encoders` False: a transformer family's text encoders are neither loaded nor built (it trains on
    the embeddings latent shards hold); their configs are still checked, and `Models.load_text_encoders`
    brings them when the pipeline is saved. The UNet family always has its own (its latent shards hold ids).
    """
    base = resolve_pretrained(pretrained) if pretrained else None
    family = preset_family(model_config, base)
    tokenizers = _tokenizer_source(tokenizer, captions)
    models = (transformer_models(family, model_config, base, pretrained, seed, vae, init_unet, device, tokenizers,
                                 text_encoders) if family else unet_models(model_config, base, pretrained, seed, vae, init_unet, device, tokenizers))
    models.base = base
    return models


TokenizerSource = Callable[[dict], tuple[dict, dict]]  # preset -> ({subfolder: tokenizer}, what the record says)


def _tokenizer_source(tokenizer: str | None, captions: Callable[[], Iterable[str]] | None) -> TokenizerSource:
    return lambda preset: text_tokenizers.resolve(preset, channel_path(tokenizer) if tokenizer else None, captions)


def unet_models(model_config: str, base: Path | None, pretrained: str | None, seed: int, vae: str | None,
                init_unet: str | None, device: torch.device, tokenizers: TokenizerSource | None = None) -> Models:
    """The UNet family's models: each part from `base` where it has one, the rest from the preset."""
    found = set(base_components(base)) if base else set()
    if init_unet == "pretrained" and "unet" not in found:
        raise BaseModelError(f"--init-unet pretrained, but the base {pretrained} has no unet/ to fine-tune")
    from_base = {name for name in found if name != "unet" or init_unet != "random"}
    if vae:
        from_base.add("vae")  # given separately: the preset's is never built
    learned, tokenization = (tokenizers or _tokenizer_source(None, None))(read_preset(model_config)) \
        if "text_encoder" not in found else ({}, {"source": f"--pretrained {pretrained}"})
    models = from_preset(model_config, seed, skip=from_base, device=device, tokenizers=learned)
    models.tokenization = tokenization
    if "vae" in found and not vae:
        models.vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    if "unet" in from_base:
        models.denoiser = UNet2DConditionModel.from_pretrained(base, subfolder="unet").to(device)
    if "scheduler" in found:  # whatever sampler the pipeline ships with, training adds noise the DDPM way
        models.noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    if "text_encoder" in found:
        models.text_encoders, models.tokenizers = _text_parts(base, found)
    if vae:
        models.vae = load_vae(vae)
    check_compatible(models, pretrained or model_config)
    models.sources = {
        "vae": f"--vae {vae}" if vae else f"--pretrained {pretrained}" if "vae" in found else preset_source(model_config),
        "text_encoder": f"--pretrained {pretrained}" if "text_encoder" in found else preset_source(model_config),
        "unet": f"--pretrained {pretrained}" if "unet" in from_base else preset_source(model_config),
        "scheduler": f"--pretrained {pretrained}" if "scheduler" in found else model_config,
    }
    for frozen in (models.vae, *models.text_encoders):
        frozen.requires_grad_(False)
        frozen.eval()
    models.denoiser.train()
    return models


def _text_parts(base: Path, found: set[str]) -> tuple[list, list]:
    """The base's text encoder(s) and their tokenizer(s): an encoder never comes without its tokenizer."""
    encoders, tokenizers = [], []
    for encoder, tokenizer, model_class in (("text_encoder", "tokenizer", CLIPTextModel),
                                            ("text_encoder_2", "tokenizer_2", CLIPTextModelWithProjection)):
        if encoder not in found:
            continue
        if tokenizer not in found:
            raise BaseModelError(f"the base {base} has {encoder}/ but no {tokenizer}/: its token ids are unknown")
        encoders.append(model_class.from_pretrained(base, subfolder=encoder))
        tokenizers.append(AutoTokenizer.from_pretrained(base, subfolder=tokenizer))
    return encoders, tokenizers


def base_components(path: Path) -> list[str]:
    """The pipeline components a base directory holds (a subfolder with a config or tokenizer files)."""
    return [name for name in COMPONENTS if (path / name).is_dir()
            and any((path / name / marker).is_file() for marker in
                    ("config.json", "scheduler_config.json", "tokenizer_config.json", "vocab.json"))]


def check_compatible(models: Models, source: str) -> None:
    """The parts fit: the UNet reads the VAE's latents and the text encoders' context."""
    latent_channels = models.vae.config.latent_channels
    if models.denoiser.config.in_channels != latent_channels:
        raise BaseModelError(f"the UNet takes {models.denoiser.config.in_channels} latent channels but the VAE makes "
                             f"{latent_channels} ({source}): use a UNet built for this VAE (--init-unet random with "
                             f"a --model-config whose unet in_channels is {latent_channels})")
    context = sum(encoder.config.hidden_size for encoder in models.text_encoders) if models.sdxl \
        else models.text_encoders[0].config.hidden_size
    if models.denoiser.config.cross_attention_dim != context:
        raise BaseModelError(f"the UNet attends to a context of {models.denoiser.config.cross_attention_dim} but the text "
                             f"encoder gives {context} ({source}): pick a --model-config whose unet "
                             f"cross_attention_dim is {context}")


def read_preset(name: str) -> dict:
    """The JSON preset `configs/<name>.json`."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise ValueError(f"unknown model config {name!r}; presets: {', '.join(known)}")
    return json.loads(path.read_text())


def preset_geometry(name: str) -> tuple[int, int]:
    """(size multiple, default resolution) of a preset's VAE and denoiser, from its configs alone (as
    `Models.size_multiple` and `default_resolution` compute them), so a run checks its resolution before
    it reads any shard (learning a tokenizer reads the shards' captions)."""
    preset = read_preset(name)
    vae_scale = 2 ** (len(preset["vae"].get("block_out_channels", [0])) - 1)
    if "transformer" in preset:
        denoiser, packing = preset["transformer"], 2 if families.family_named(preset["family"]).packs_latents else 1
        return vae_scale * denoiser.get("patch_size", 2) * packing, denoiser["sample_size"] * vae_scale
    denoiser = preset["unet"]
    return vae_scale * 2 ** (len(denoiser["block_out_channels"]) - 1), denoiser["sample_size"] * vae_scale


def from_preset(name: str, seed: int, skip: Collection[str] = (), device: torch.device = CPU,
                tokenizers: dict | None = None) -> Models:
    """Fresh weights for the preset's architecture; the same seed gives the same weights on the same kind
    of device. Components named in `skip` (the ones a base brings) are not built and are None until the
    caller fills them.

    The UNet is built on `device`, the one that trains it. A CPU draws random init one number at a time
    (sd2's 866M UNet parameters: about two thirds of the 13.9 s its GPU job spent building models,
    bench/train_first_step.py); a GPU draws them in parallel, and nothing is copied after. The draws come from
    that device's generator, so a CUDA-built UNet is not the CPU-built one of the same seed. Every rank
    of a job has the same kind of GPU, so the ranks still agree. The frozen parts are always drawn on
    the CPU: latent shards name the VAE and text encoders by their weights (trainer/data/latents.py), and
    the encode job that wrote them may have run on another device.

    The text encoders are built for `tokenizers` ({subfolder: tokenizer}, trainer/models/text_tokenizers.py;
    None: learned from no captions, byte-level, as tests build them)."""
    preset = read_preset(name)
    if tokenizers is None and "text_encoder" not in skip:
        tokenizers = text_tokenizers.learn(preset, [])
    torch.manual_seed(seed)
    chosen, text_encoders = [], []
    for (key, folder), model_class in zip(text_tokenizers.UNET_TEXT_PARTS, (CLIPTextModel, CLIPTextModelWithProjection)):
        if key not in preset or "text_encoder" in skip:
            continue
        tokenizer = tokenizers[folder]
        text_config = CLIPTextConfig(
            **{**preset[key], "vocab_size": len(tokenizer)},  # the tokenizer's ids, never more
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        chosen.append(tokenizer)
        text_encoders.append(model_class(text_config))
    # each part seeded on its own: a preset UNet is the same whether or not a base brings the rest
    return Models(
        vae=None if "vae" in skip else seeded(seed, AutoencoderKL, preset["vae"]),
        text_encoders=text_encoders,
        tokenizers=chosen,
        denoiser=None if "unet" in skip else seeded(seed, UNet2DConditionModel, preset["unet"], device),
        noise_scheduler=DDPMScheduler(**preset["scheduler"]),
    )


def seeded(seed: int, model_class, config: dict, device: torch.device = CPU):
    """The model built with its parameters allocated and initialised on `device`."""
    torch.manual_seed(seed)  # every device's generator
    with torch.device(device):
        return model_class(**config)


def channel_path(value: str) -> Path:
    """A local path, or the directory of the SageMaker channel of that name; a `model.tar.gz` in it unpacked."""
    path = Path(value)
    if not path.exists() and os.environ.get(f"SM_CHANNEL_{value.upper()}"):
        path = Path(os.environ[f"SM_CHANNEL_{value.upper()}"])
    archive = path if path.is_file() else path / MODEL_ARCHIVE
    if archive.is_file() and archive.name.endswith(".tar.gz"):
        unpacked = Path(tempfile.mkdtemp(prefix="atelier-base-"))
        # the models read from it may keep files mapped until the process ends: removed then, not before
        atexit.register(shutil.rmtree, unpacked, ignore_errors=True)
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(unpacked, filter="data")
        except (tarfile.TarError, OSError, EOFError) as error:
            raise BaseModelError(f"{value}: {archive.name} cannot be unpacked ({error})") from None
        path = unpacked
    if not path.is_dir():
        raise BaseModelError(f"{value} is neither a directory nor a channel (no SM_CHANNEL_{value.upper()})")
    return path


def resolve_pretrained(value: str) -> Path:
    """A base directory from `--pretrained`: a diffusers pipeline, or some of its component subfolders."""
    path = channel_path(value)
    if not base_components(path):
        raise BaseModelError(f"--pretrained {value} is not a diffusers pipeline directory or channel (no "
                             f"{', '.join(COMPONENTS)} subfolder with a config)")
    return path


def load_vae(value: str) -> AutoencoderKL:
    """The VAE from `--vae`: an AutoencoderKL directory (the autoencoder job's model), or a pipeline's `vae/`."""
    path = channel_path(value)
    folder = path / "vae" if (path / "vae" / "config.json").is_file() else path
    try:
        return AutoencoderKL.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as error:
        raise BaseModelError(f"--vae {value} holds no diffusers AutoencoderKL ({type(error).__name__}: {error})") from None


def from_pretrained(path: Path) -> Models:
    """The components of a whole diffusers pipeline saved at `path` (a local directory, never a hub id), the LoRA
    adapter it may hold merged into its denoiser once its base is checked (trainer/models/lora.py)."""
    family = families.family_of_pipeline(path)
    if family is not None:
        models = transformer_models(family, None, path, str(path), 0, None, "pretrained", CPU)
        # sample as the run saved it: its sampler's shift at the size it ended at, scaled for other sizes
        models.flow = FlowSettings(shift_at_reference=family.saved_shift(path), reference_resolution=models.default_resolution)
        families.note_training(models.denoiser, families.saved_record(path))  # guided as its record says
    else:
        text_encoders, tokenizers = _text_parts(path, set(base_components(path)))
        models = Models(
            vae=AutoencoderKL.from_pretrained(path, subfolder="vae"),
            text_encoders=text_encoders,
            tokenizers=tokenizers,
            denoiser=UNet2DConditionModel.from_pretrained(path, subfolder="unet"),
            noise_scheduler=DDPMScheduler.from_pretrained(path, subfolder="scheduler"),
        )
    adapter = lora.verified_adapter(path)
    if adapter is not None:
        lora.merge_adapter(models.denoiser, path, adapter)
    return models


# ---------------------------------------------------------------- transformer families (trainer/models/families.py)


def preset_family(model_config: str, base: Path | None) -> Family | None:
    """The transformer family of a run: the base's when it holds a transformer, else the preset's."""
    if base is not None and (base / "transformer" / "config.json").is_file():
        class_name = json.loads((base / "transformer" / "config.json").read_text()).get("_class_name")
        family = next((f for f in families.FAMILIES.values() if f.transformer_class.__name__ == class_name), None)
        if family is None:
            raise BaseModelError(f"the base {base} holds a {class_name} transformer, which no family trains")
        return family
    if model_config is None:
        return None
    name = read_preset(model_config).get("family", "unet")
    return None if name == "unet" else families.family_named(name)


def transformer_models(family: Family, model_config: str | None, base: Path | None, pretrained: str | None, seed: int,
                       vae: str | None, init: str | None, device: torch.device,
                       tokenizers: TokenizerSource | None = None, text_encoders: bool = True) -> Models:
    """A transformer family's models: each part from `base` where it has one (the transformer unless
    `init` is `random`), the VAE from `vae` when given, the rest built from the preset with `seed`; the
    text encoders only described (`Models.text_origin`) unless `text_encoders`."""
    preset = read_preset(model_config) if model_config else {}
    has = (lambda name: base is not None and (base / name / "config.json").is_file())
    if init == "pretrained" and not has("transformer"):
        raise BaseModelError(f"--init-unet pretrained, but the base {pretrained} has no transformer/ to fine-tune")
    try:
        if base is not None and has(family.text_parts[0].encoder):
            configs, loaded = families.load_text_configs(family, base), families.load_tokenizers(family, base)
            origin = {"files": {folder: base / folder for folder in configs}}
            load_text = (lambda: families.load_text_parts(family, base)[0])
            tokenization = {"source": f"--pretrained {pretrained}"}
        else:
            learned, tokenization = (tokenizers or _tokenizer_source(None, None))(preset)
            configs = {folder: config for folder, (_, config) in families.text_configs(family, preset, learned).items()}
            loaded = {part.tokenizer: learned[part.tokenizer] for part in family.text_parts if part.encoder in configs}
            origin = {"built": configs, "seed": seed}
            load_text = (lambda: families.build_text_parts(family, preset, seed, learned)[0])
        encoders = load_text() if text_encoders else {}
        if has("transformer") and init != "random":
            transformer = families.load_transformer(family, base).to(device)
        else:
            transformer = seeded(seed, lambda **config: families.new_transformer(family, config), preset["transformer"], device)
        autoencoder = load_vae(vae) if vae else families.load_vae(base) if has("vae") else seeded(seed, AutoencoderKL, preset["vae"])
        families.check_fits(family, transformer, autoencoder, configs, pretrained or model_config)
    except (KeyError, ValueError) as error:
        raise BaseModelError(f"{family.name} model from {pretrained or model_config}: {error}") from None
    folders = [(part.encoder, part.tokenizer) for part in family.text_parts if part.encoder in configs]
    models = Models(vae=autoencoder, text_encoders=[encoders[e] for e, _ in folders if e in encoders],
                    tokenizers=[loaded[t] for _, t in folders], denoiser=transformer, noise_scheduler=None,
                    family=family, flow=FlowSettings.from_preset(preset.get("flow")), text_folders=folders,
                    text_origin=origin, text_loader=load_text)
    models.tokenization = tokenization
    origin = (lambda name: f"--pretrained {pretrained}" if has(name) else preset_source(model_config))
    models.sources = {"vae": f"--vae {vae}" if vae else origin("vae"), "text_encoder": origin(family.text_parts[0].encoder),
                      "transformer": origin("transformer") if init != "random" else preset_source(model_config),
                      "scheduler": "flow matching"}
    for frozen in (models.vae, *models.text_encoders):
        frozen.requires_grad_(False)
        frozen.eval()
    transformer.train()
    return models
