"""The transformer families: two MMDiTs (SD3, and Flux.1's layout of double- and single-stream blocks)
and a cross-attention DiT (PixArt-Sigma), trained with flow matching (trainer/flow_matching.py), built
from diffusers' and transformers' own classes.

A preset names its family (`"family": "sd3"`, `"flux"` or `"pixart"`) and gives the configs of its parts:
`transformer` (the diffusers class's config), `vae` (AutoencoderKL: 16 latent channels for SD3 and
Flux, 4 for PixArt), `text_encoders` by role (`clip_l` and `clip_g`, CLIPTextModelWithProjection, and an
optional `t5` for SD3; `clip_l`, CLIPTextModel, and `t5` for Flux; `t5`, T5EncoderModel, for PixArt) and
`flow` (flow_matching.FlowSettings).
A `--pretrained` pipeline folder brings any of them instead (`text_encoder*`/`tokenizer*`, `vae`,
`transformer`), as for the UNet family.

Captions condition the transformer exactly as the family's pipeline conditions it at sampling: the
trainer calls the pipeline's own `encode_prompt` (on a pipeline holding the text parts), so a model is
trained on the embeddings it is served with:
- SD3: CLIP-L's and CLIP-G's penultimate hidden states side by side, zero-padded to the T5 width and
  followed by T5's last hidden state (zeros without a T5), plus both CLIPs' pooled projections.
- Flux: T5's last hidden state (all 512 positions: the transformer attends to the padding too) and
  CLIP-L's pooled output. Its transformer reads the latents packed as tokens of 2x2 latent pixels
  with their positions as ids (rotary: no table to outgrow), and the timestep in [0, 1].
- PixArt: T5's last hidden state and its attention mask.
On latent shards the encode job has stored these (trainer/data/latents.py) and training loads no text
encoder; `text_configs`/`load_text_configs` give their configs without weights, so the parts are still checked.

The saved sampler: SD3 and Flux save `FlowMatchEulerDiscreteScheduler` with the last phase's shift (Flux's
without its dynamic shifting, so sampling shifts as training did). A Flux transformer without guidance
embeddings guides only by true classifier-free guidance (`true_cfg_scale` and a negative prompt, two transformer
calls a step). It is sampled so unasked (the empty negative) only where its run's record, atelier-training.json,
says it learned an unconditional prediction: built here from the preset and trained with caption dropout
(`learned_unconditional`). Any other (FLUX.1-schnell, timestep-distilled to sample unguided; a LoRA or fine-tune
on it; a folder trained elsewhere) samples as FluxPipeline does by default, with true CFG only for a call that
gives a negative prompt. A guidance-distilled base (`guidance_embeds`) trains and samples with the embedded
guidance, as diffusers' Flux scripts do.
PixArtSigmaPipeline reads `init_noise_sigma` and calls `scale_model_input`, which the flow-matching
Euler scheduler lacks, so PixArt saves `DPMSolverMultistepScheduler` in its flow mode
(`use_flow_sigmas`, `prediction_type="flow_prediction"`, the same shift): the sampler diffusers
gives flow-matching DiTs of the PixArt line (Sana).
"""

import contextlib
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from diffusers import (AutoencoderKL, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, PixArtSigmaPipeline, PixArtTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline)
from transformers import (AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                          T5EncoderModel)

from contracts.model_presets import flow_refusal
from contracts.s3_layout import TRAINING_RECORD
from trainer.objectives.flow_matching import TIMESTEP_SCALE


@dataclass(frozen=True)
class TextPart:
    """One text encoder of a family: its role in a preset, its pipeline subfolders and class."""
    role: str  # the preset's key: clip_l, clip_g, t5
    encoder: str  # the pipeline's subfolder and argument name
    tokenizer: str
    encoder_class: type
    required: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    transformer_class: type
    pipeline_class: type
    text_parts: tuple[TextPart, ...]
    max_length: int  # the pipeline's default max_sequence_length for T5: training uses what sampling will
    shifts_latents: bool  # latents = (z - shift_factor) * scaling_factor (SD3), else z * scaling_factor
    # the pipeline lowercases and strips a prompt before its T5 tokenizer sees it (PixArtSigmaPipeline's
    # _text_preprocessing without clean_caption), so its tokenizer is learned and measured on that text
    lowercases_prompts: bool = False
    # the transformer reads latents packed as tokens of 2x2 latent pixels, with position ids (Flux)
    packs_latents: bool = False
    # the SDPA backends its training steps may use (empty: torch's choice); see training_attention
    training_backends: tuple[SDPBackend, ...] = ()

    def saved_scheduler(self, shift: float):
        """The sampler saved with the pipeline, at the run's last shift."""
        if self.pipeline_class is not PixArtSigmaPipeline:
            return FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)
        return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)

    def saved_shift(self, path: Path) -> float:
        """The shift of the sampler a saved pipeline at `path` holds (1: none); a sampler that shifts by the image's
        tokens (FLUX.1's `use_dynamic_shifting`) gives its shift at the model's own size."""
        config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        if config.get("use_dynamic_shifting"):
            transformer = json.loads((path / "transformer" / "config.json").read_text())
            return dynamic_shift(config, (sample_size(transformer) // 2) ** 2)
        return float(config.get("flow_shift" if self.pipeline_class is PixArtSigmaPipeline else "shift") or 1.0)


SD3 = Family("sd3", SD3Transformer2DModel, StableDiffusion3Pipeline, (
    TextPart("clip_l", "text_encoder", "tokenizer", CLIPTextModelWithProjection),
    TextPart("clip_g", "text_encoder_2", "tokenizer_2", CLIPTextModelWithProjection),
    TextPart("t5", "text_encoder_3", "tokenizer_3", T5EncoderModel, required=False),
), max_length=256, shifts_latents=True)
# Flux's attention in training, never on cuDNN's SDPA kernels: with torch 2.11 on an H100 their backward, and the
# default backend's, which behaved as theirs, gave NaN gradients (tiny-flux, 576 tokens) or a faulting kernel
# (FLUX.1's layout at 256 px) where flash and memory-efficient attention gave finite ones (bench/RESULTS.md,
# 2026-12-06). Forward-only sampling and serving keep the default.
FLUX_TRAINING_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
FLUX = Family("flux", FluxTransformer2DModel, FluxPipeline, (
    TextPart("clip_l", "text_encoder", "tokenizer", CLIPTextModel),
    TextPart("t5", "text_encoder_2", "tokenizer_2", T5EncoderModel),
), max_length=512, shifts_latents=True, packs_latents=True, training_backends=FLUX_TRAINING_ATTENTION)
PIXART = Family("pixart", PixArtTransformer2DModel, PixArtSigmaPipeline, (
    TextPart("t5", "text_encoder", "tokenizer", T5EncoderModel),
), max_length=300, shifts_latents=False, lowercases_prompts=True)
FAMILIES = {family.name: family for family in (SD3, FLUX, PIXART)}
FLUX_TRAINING_GUIDANCE = 3.5  # a guidance-distilled base's embedded guidance in training (diffusers' Flux scripts)
FLUX_SAMPLING_GUIDANCE = 3.5  # true CFG for an undistilled Flux where a call names no scale (FluxPipeline's own default)
FLUX_DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline's default latent side (1024 px), for a transformer config without one


def dynamic_shift(scheduler_config: dict, tokens: int) -> float:
    """exp(mu) for an image of `tokens` packed tokens, mu linear in them between the scheduler's base and max shift
    (diffusers' calculate_shift, as FluxPipeline calls it); shifted() by it is the scheduler's exponential time shift."""
    base_tokens, max_tokens = scheduler_config.get("base_image_seq_len", 256), scheduler_config.get("max_image_seq_len", 4096)
    base, top = scheduler_config.get("base_shift", 0.5), scheduler_config.get("max_shift", 1.15)
    return math.exp(base + (top - base) * (tokens - base_tokens) / (max_tokens - base_tokens))


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; transformer families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_pipeline(path: Path) -> Family | None:
    """The family of a saved pipeline folder, from its model_index.json (None: not a transformer family)."""
    index = path / "model_index.json"
    if not index.is_file():
        return None
    class_name = json.loads(index.read_text()).get("_class_name")
    return next((family for family in FAMILIES.values() if family.pipeline_class.__name__ == class_name), None)


@dataclass
class Conditioning:
    """What the text encoders give the transformer for a batch of captions."""
    context: torch.Tensor  # [batch, tokens, width]
    pooled: torch.Tensor | None = None  # SD3's pooled CLIP projections
    mask: torch.Tensor | None = None  # PixArt's T5 attention mask
    # the token positions some caption of the batch holds (after them the context is zero padding), known
    # without reading the mask off the device; None: every position may hold one
    positions: int | None = None
    packed: bool = False  # Flux: the transformer reads packed latents and position ids (layout())
    guidance: float | None = None  # Flux: a guidance-distilled transformer's embedded guidance

    def repeat_interleave(self, count: int) -> "Conditioning":
        return Conditioning(*(None if part is None else part.repeat_interleave(count, dim=0)
                              for part in (self.context, self.pooled, self.mask)), positions=self.positions,
                            packed=self.packed, guidance=self.guidance)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its parts by the names the family's pipeline gives and takes them (what latent shards store)."""
        return {name: getattr(self, part) for part, name in STORED_NAMES.items() if getattr(self, part) is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "Conditioning":
        return cls(**{part: tensors[name] for part, name in STORED_NAMES.items() if name in tensors})


STORED_NAMES = {"context": "prompt_embeds", "pooled": "pooled_prompt_embeds", "mask": "prompt_attention_mask"}


def layout(family: Family, transformer, conditioning: Conditioning) -> Conditioning:
    """`conditioning` marked with how `transformer` reads its inputs: packed latents and, for a guidance-distilled
    Flux transformer, the embedded guidance it trains at (what stored embeddings cannot say)."""
    if family.packs_latents:
        conditioning.packed = True
        conditioning.guidance = FLUX_TRAINING_GUIDANCE if transformer.config.guidance_embeds else None
    return conditioning


# ---------------------------------------------------------------- building and loading


def text_configs(family: Family, preset: dict, tokenizers: dict) -> dict:
    """{subfolder: (encoder class, config)} of the preset's text encoders as built for `tokenizers` (by
    subfolder; trainer/models/text_tokenizers.py: learned, or the tokenizer channel's)."""
    configs = preset.get("text_encoders", {})
    missing = [part.role for part in family.text_parts if part.required and part.role not in configs]
    if missing:
        raise ValueError(f"a {family.name} preset needs text_encoders {', '.join(missing)}")
    built = {}
    for part in family.text_parts:
        if part.role not in configs:
            continue
        tokenizer = tokenizers[part.tokenizer]
        config = {**configs[part.role], "vocab_size": len(tokenizer)}  # the tokenizer's ids, never more
        if part.encoder_class is T5EncoderModel:
            built[part.encoder] = (part.encoder_class, T5Config(
                **config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id))
        else:
            built[part.encoder] = (part.encoder_class, CLIPTextConfig(
                **config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id))
    return built


def build_text_parts(family: Family, preset: dict, seed: int, tokenizers: dict) -> tuple[dict, dict]:
    """({subfolder: encoder}, {subfolder: tokenizer}) with fresh weights (drawn on the CPU from `seed`, each
    encoder on its own) from the preset's configs, for `tokenizers` by subfolder."""
    encoders = {}
    for folder, (encoder_class, config) in text_configs(family, preset, tokenizers).items():
        torch.manual_seed(seed)
        encoders[folder] = encoder_class(config)
    return encoders, {part.tokenizer: tokenizers[part.tokenizer] for part in family.text_parts if part.encoder in encoders}


def base_text_parts(family: Family, base: Path) -> list[TextPart]:
    """The family's text parts a base pipeline folder holds (an encoder never comes without its tokenizer)."""
    parts = []
    for part in family.text_parts:
        if not (base / part.encoder / "config.json").is_file():
            if part.required:
                raise ValueError(f"the base {base} has no {part.encoder}/ ({part.role}), which a {family.name} model needs")
            continue
        if not (base / part.tokenizer).is_dir():
            raise ValueError(f"the base {base} has {part.encoder}/ but no {part.tokenizer}/: its token ids are unknown")
        parts.append(part)
    return parts


def load_text_parts(family: Family, base: Path) -> tuple[dict, dict]:
    """The text encoders and tokenizers a base pipeline folder holds for this family."""
    parts = base_text_parts(family, base)
    return ({part.encoder: part.encoder_class.from_pretrained(base, subfolder=part.encoder) for part in parts},
            load_tokenizers(family, base))


def load_tokenizers(family: Family, base: Path) -> dict:
    """The tokenizers of the base's text parts, without their encoders."""
    return {part.tokenizer: AutoTokenizer.from_pretrained(base, subfolder=part.tokenizer)
            for part in base_text_parts(family, base)}


def load_text_configs(family: Family, base: Path) -> dict:
    """{subfolder: config} of the base's text encoders, read from their config.json alone (no weights)."""
    return {part.encoder: part.encoder_class.config_class.from_pretrained(base / part.encoder)
            for part in base_text_parts(family, base)}


def new_transformer(family: Family, config: dict):
    """A fresh transformer of the preset's `config`. Flux's class takes no `sample_size`: it is kept in the config
    (as the other families keep theirs), where the saved pipeline's default image size is read from (prepared())."""
    if not family.packs_latents or "sample_size" not in config:
        return family.transformer_class(**config)
    transformer = family.transformer_class(**{key: value for key, value in config.items() if key != "sample_size"})
    transformer.register_to_config(sample_size=config["sample_size"])
    return transformer


def sample_size(config) -> int:
    """A denoiser config's default latent side: its `sample_size`, else FluxPipeline's fixed 128 (a Flux
    transformer from elsewhere, FLUX.1-dev's, holds none)."""
    return config.get("sample_size") or FLUX_DEFAULT_SAMPLE_SIZE


def size_multiple(transformer, vae_scale_factor: int) -> int:
    """Image sides a transformer can take are multiples of this: the VAE's downsampling times its patch (Flux:
    its 2x2 packing of latent pixels)."""
    packing = 2 if isinstance(transformer, FluxTransformer2DModel) else 1
    return vae_scale_factor * (transformer.config.get("patch_size") or 1) * packing


def load_transformer(family: Family, base: Path):
    return family.transformer_class.from_pretrained(base, subfolder="transformer")


def load_vae(base: Path) -> AutoencoderKL:
    return AutoencoderKL.from_pretrained(base, subfolder="vae")


def check_fits(family: Family, transformer, vae: AutoencoderKL, encoders: dict, source: str) -> None:
    """The parts fit: the transformer reads the VAE's latents and the text encoders' widths (`encoders`: their
    configs by subfolder, so the check needs no weights)."""
    config = transformer.config
    channels = config.in_channels // 4 if family.packs_latents else config.in_channels  # Flux: 2x2 latent pixels a token
    if channels != vae.config.latent_channels:
        raise ValueError(f"the transformer takes {channels} latent channels but the VAE makes "
                         f"{vae.config.latent_channels} ({source})")
    if family.shifts_latents and vae.config.shift_factor is None:
        raise ValueError(f"a {family.name} model's VAE needs a shift_factor ({source})")
    if family is FLUX:
        widths = {"pooled_projection_dim": (config.pooled_projection_dim, encoders["text_encoder"].hidden_size, "CLIP-L"),
                  "joint_attention_dim": (config.joint_attention_dim, encoders["text_encoder_2"].d_model, "T5")}
        for name, (wanted, given, encoder) in widths.items():
            if wanted != given:
                raise ValueError(f"the transformer's {name} is {wanted} but {encoder} gives {given} ({source})")
    elif family is SD3:
        clips = [encoders[name] for name in ("text_encoder", "text_encoder_2")]
        pooled = sum(encoder.projection_dim for encoder in clips)
        if pooled != config.pooled_projection_dim:
            raise ValueError(f"the transformer's pooled_projection_dim is {config.pooled_projection_dim} but the CLIP "
                             f"projections give {pooled} ({source})")
        widths = [sum(encoder.hidden_size for encoder in clips)]
        if "text_encoder_3" in encoders:
            widths.append(encoders["text_encoder_3"].d_model)
        if max(widths) > config.joint_attention_dim or widths[-1] != config.joint_attention_dim and len(widths) == 2:
            raise ValueError(f"the transformer's joint_attention_dim is {config.joint_attention_dim} but the text "
                             f"encoders give widths {widths} ({source})")
    elif encoders["text_encoder"].d_model != config.caption_channels:
        raise ValueError(f"the transformer's caption_channels is {config.caption_channels} but T5 gives "
                         f"{encoders['text_encoder'].d_model} ({source})")


def position_cover(transformer, vae_scale_factor: int) -> int | None:
    """The image side an SD3 transformer's position table covers (`pos_embed_max_size` patches, cropped to each
    image), in pixels; None for a transformer that computes its positions for any size (PixArt) or a UNet."""
    table = transformer.config.get("pos_embed_max_size")
    return table * transformer.config.patch_size * vae_scale_factor if table else None


def check_positions(transformer, vae_scale_factor: int, side: int, source: str) -> None:
    """The transformer's position table covers the run's widest image `side`: refused before the first step,
    not when the stage that needs it starts."""
    covered = position_cover(transformer, vae_scale_factor)
    if covered is not None and side > covered:
        raise ValueError(f"the run's widest image side is {side} px (its largest phase's aspect buckets), but the "
                         f"transformer's position table covers {covered} px (pos_embed_max_size "
                         f"{transformer.config.pos_embed_max_size}, {source}): train with --aspect-buckets false, at a "
                         "lower resolution, or with a larger pos_embed_max_size")


# ---------------------------------------------------------------- conditioning, prediction, pipeline


def text_pipeline(family: Family, transformer, encoders: dict, tokenizers: dict):
    """The family's pipeline without VAE and scheduler: its `encode_prompt` is what conditions training."""
    parts = {name: None for name in inspect.signature(family.pipeline_class.__init__).parameters
             if name not in ("self", "image_encoder", "feature_extractor")}
    return family.pipeline_class(**{**parts, "transformer": transformer, **encoders, **tokenizers})


@torch.no_grad()
def condition(family: Family, pipeline, captions: list[str], device: torch.device) -> Conditioning:
    """The captions' conditioning, computed by the family's pipeline as it does at sampling."""
    if family is SD3:
        context, _, pooled, _ = pipeline.encode_prompt(captions, None, None, device=device,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=family.max_length)
        return Conditioning(context, pooled=pooled)
    if family is FLUX:
        context, pooled, _ = pipeline.encode_prompt(captions, None, device=device, max_sequence_length=family.max_length)
        return layout(family, pipeline.transformer, Conditioning(context, pooled=pooled))
    # T5 runs on the longest caption's tokens, not the 300 the pipeline pads to: the padded positions are masked
    # out of the transformer's cross-attention and stored as zeros, and the real ones do not depend on the padding
    texts = pipeline._text_preprocessing(captions, clean_caption=False)  # what encode_prompt tokenizes
    longest = max(len(ids) for ids in pipeline.tokenizer(texts, truncation=True, max_length=family.max_length).input_ids)
    context, mask, _, _ = pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=device,
                                                 max_sequence_length=longest)
    missing = family.max_length - context.shape[1]
    return Conditioning(F.pad(context * mask[..., None].to(context.dtype), (0, 0, 0, missing)), mask=F.pad(mask, (0, missing)),
                        positions=longest)


@torch.no_grad()
def prompt_embeddings(family: Family, pipeline, prompts: list[str]) -> dict[str, torch.Tensor]:
    """The pipeline call's embedding arguments for `prompts` and the empty negative prompt (guidance), on the
    CPU, as its own encode_prompt computes them: what a pipeline without text encoders samples from."""
    cpu = torch.device("cpu")
    if family is SD3:
        embeds, negative, pooled, negative_pooled = pipeline.encode_prompt(
            prompts, None, None, device=cpu, do_classifier_free_guidance=True, negative_prompt="",
            max_sequence_length=family.max_length)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative, "pooled_prompt_embeds": pooled,
                "negative_pooled_prompt_embeds": negative_pooled}
    if family is FLUX:
        (embeds, pooled, _), (negative, negative_pooled, _) = (
            pipeline.encode_prompt(texts, None, device=cpu, max_sequence_length=family.max_length)
            for texts in (prompts, [""] * len(prompts)))
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative, "pooled_prompt_embeds": pooled,
                "negative_pooled_prompt_embeds": negative_pooled}
    embeds, mask, negative, negative_mask = pipeline.encode_prompt(
        prompts, do_classifier_free_guidance=True, negative_prompt="", device=cpu, max_sequence_length=family.max_length)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask, "negative_prompt_embeds": negative,
            "negative_prompt_attention_mask": negative_mask}


def training_attention(family: Family | None):
    """The context a training step's forward and backward run in together: the family's SDPA backends (none for
    the UNet family, or a family that names none). Together, because gradient checkpointing recomputes the forward
    inside the backward: a recompute outside the forward's backends picks other kernels, whose saved tensors fail
    torch.utils.checkpoint's metadata check (FLUX.1's layout at 1024 px with checkpointing did, 2026-12-06)."""
    if family is None or not family.training_backends:
        return contextlib.nullcontext()
    return sdpa_kernel(list(family.training_backends))


def predict(transformer, noisy: torch.Tensor, t: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
    """The transformer's velocity for latents `noisy` at timesteps `t` in [0, 1]."""
    if conditioning.packed:
        return _predict_packed(transformer, noisy, t, conditioning)
    timestep = t * TIMESTEP_SCALE
    if conditioning.mask is None:
        return transformer(hidden_states=noisy, encoder_hidden_states=conditioning.context,
                           pooled_projections=conditioning.pooled, timestep=timestep).sample
    output = transformer(noisy, encoder_hidden_states=conditioning.context, encoder_attention_mask=conditioning.mask,
                         timestep=timestep, added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    return output[:, :noisy.shape[1]]  # a learned-variance layout (2x channels) keeps its first half


def _predict_packed(transformer, noisy: torch.Tensor, t: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
    """Flux's velocity: the latents packed as tokens of 2x2 latent pixels with their (0, row, column) ids, the
    text's ids zero, the timestep (and a distilled model's guidance) in [0, 1] as FluxPipeline passes them;
    the tokens unpacked back to latents."""
    batch, channels, height, width = noisy.shape
    tokens = FluxPipeline._pack_latents(noisy, batch, channels, height, width)
    image_ids = _image_ids(height // 2, width // 2, noisy.device, noisy.dtype)
    text_ids = torch.zeros(conditioning.context.shape[1], 3, device=noisy.device, dtype=noisy.dtype)
    guidance = None if conditioning.guidance is None else torch.full((batch,), conditioning.guidance, device=noisy.device)
    output = transformer(hidden_states=tokens, encoder_hidden_states=conditioning.context,
                         pooled_projections=conditioning.pooled, timestep=t, img_ids=image_ids, txt_ids=text_ids,
                         guidance=guidance).sample
    return (output.view(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
            .reshape(batch, channels, height, width))


def _image_ids(rows: int, columns: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each packed token's (0, row, column), as FluxPipeline._prepare_latent_image_ids gives them, but made on the
    device: that one builds them on the CPU and copies them over, a synchronisation a CUDA graph capture refuses."""
    grid = torch.meshgrid(torch.arange(rows, device=device), torch.arange(columns, device=device), indexing="ij")
    return torch.stack([torch.zeros_like(grid[0]), *grid], dim=-1).reshape(rows * columns, 3).to(dtype)


def build_pipeline(family: Family, transformer, vae: AutoencoderKL, encoders: dict, tokenizers: dict, shift: float):
    """The family's diffusers pipeline around `transformer`, with the flow sampler at `shift`."""
    parts = {"transformer": transformer, "vae": vae, "scheduler": family.saved_scheduler(shift), **encoders, **tokenizers}
    for part in family.text_parts:  # absent: an optional encoder (SD3's T5), or a run on stored embeddings
        parts.setdefault(part.encoder, None)
        parts.setdefault(part.tokenizer, None)
    return prepared(family.pipeline_class(**parts))


def prepared(pipeline):
    """A loaded or built pipeline that draws at its model's own size when a call names none: FluxPipeline's
    default is a fixed 128 latent pixels a side, whatever its transformer trained at (the others read it from
    their denoiser's config)."""
    if isinstance(pipeline, FluxPipeline):
        pipeline.default_sample_size = sample_size(pipeline.transformer.config)
    return pipeline


def check_flow_run(family: Family, args) -> None:
    """What a flow-matching run cannot take, refused at its start: the UNet family's noise-schedule options (a
    preset's family is refused them when the options are parsed too, and by the pipeline before a job starts)."""
    if refusal := flow_refusal(family.name, args.prediction_type, args.zero_terminal_snr, args.snr_gamma, args.noise_offset):
        raise ValueError(refusal)


def absent_parts(path: Path) -> dict:
    """What `DiffusionPipeline.from_pretrained` must be told is absent from a saved pipeline: an SD3 model
    without a T5 saves `text_encoder_3` as null, which StableDiffusion3Pipeline does not list as optional."""
    family = family_of_pipeline(path)
    if family is None:
        return {}
    index = json.loads((path / "model_index.json").read_text())
    return {name: None for part in family.text_parts if not part.required
            for name in (part.encoder, part.tokenizer) if (index.get(name) or [None])[0] is None}


# learned_unconditional's answer, kept on the transformer's config for true_cfg: a private ("_") key, which diffusers
# keeps through save and load but passes to no constructor
LEARNED_UNCONDITIONAL = "_atelier_learned_unconditional"


BUILT_FROM_PRESET = "(random)"  # the end of a part's source in a run's record (Models.sources) when built here


def preset_source(model_config: str) -> str:
    """How a run's record names a part built here with fresh weights from the preset."""
    return f"{model_config} {BUILT_FROM_PRESET}"


def learned_unconditional(record: dict | None, base_record: dict | None = None) -> bool:
    """Whether a run's record (atelier-training.json: its `learned_unconditional`, else its `args` and `components`)
    says its transformer learned an unconditional prediction to guide by: trained with captions dropped to "", on a
    transformer built here from the preset (its source is preset_source's) or on a base whose own record says it
    learned one (`base_record`: a run continued on a model trained here). A base trained elsewhere learned none we
    know of (FLUX.1-schnell is distilled to sample unguided), nor did a LoRA or fine-tune on it. No record, no such
    knowledge."""
    if not record:
        return False
    if "learned_unconditional" in record:  # written at the end of each run (trainer/jobs/train.py)
        return bool(record["learned_unconditional"])
    if float((record.get("args") or {}).get("caption_dropout") or 0) <= 0:
        return False
    components = record.get("components") or {}
    built_here = str(components.get("transformer") or components.get("unet") or "").endswith(BUILT_FROM_PRESET)
    return built_here or learned_unconditional(base_record)


def saved_record(path: Path | None) -> dict | None:
    """The training record beside a saved pipeline; None for a folder trained elsewhere, or a record that does not
    read as one (then nothing is known of its training)."""
    try:
        read = json.loads((Path(path) / TRAINING_RECORD).read_text()) if path is not None else None
    except (OSError, ValueError):  # no record (a folder trained elsewhere), or not one
        return None
    return read if isinstance(read, dict) else None


def note_training(denoiser, record: dict | None, base_record: dict | None = None) -> None:
    """Note on a Flux transformer's config what its run's record says (learned_unconditional), where true_cfg reads
    it: validation notes the run's own arguments and sources (and its base's record), serving and evaluation the
    saved record. Read from the record rather than saved in the config: models trained before it was read keep
    their guidance."""
    if isinstance(denoiser, FluxTransformer2DModel):
        denoiser.register_to_config(**{LEARNED_UNCONDITIONAL: learned_unconditional(record, base_record)})


def guides_by_negative(pipeline) -> bool:
    """Whether the pipeline's only guidance is true classifier-free guidance, which takes a negative prompt and
    `true_cfg_scale` and calls its transformer twice a step: a Flux transformer without guidance embeddings
    (FluxPipeline ignores guidance_scale then)."""
    return isinstance(pipeline, FluxPipeline) and not pipeline.transformer.config.guidance_embeds


def true_cfg(pipeline) -> bool:
    """Whether the pipeline is sampled with true CFG when a call gives no negative prompt (then the empty one): it
    guides by a negative and its transformer learned an unconditional prediction (note_training)."""
    return guides_by_negative(pipeline) and bool(pipeline.transformer.config.get(LEARNED_UNCONDITIONAL))


def embedded_guidance(pipeline) -> bool:
    """Whether the pipeline's guidance is an input of its transformer (a guidance-distilled Flux, FLUX.1-dev's),
    with no negative prompt to guide away from."""
    return isinstance(pipeline, FluxPipeline) and bool(pipeline.transformer.config.guidance_embeds)


def negative_prompt(pipeline, value, prompts: int | None = None):
    """The request's negative prompt as the pipeline takes it: PixArt's pipelines need a string where none is
    given, and a Flux that learned an unconditional prediction (true_cfg) guides only with one; for a call of
    several `prompts`, one empty negative each (Flux
    encodes a lone "" once, a batch of one beside the prompts' batch)."""
    if value is not None or not (isinstance(pipeline, PixArtSigmaPipeline) or true_cfg(pipeline)):
        return value
    return "" if prompts is None else [""] * prompts


def sampling_options(pipeline, guidance_scale: float | None = None, negative=None) -> dict:
    """Keyword arguments the pipeline needs to draw exactly the asked height and width, from the prompt as it was
    trained, guided by `guidance_scale` (None: the pipeline's default): PixArt's pipelines otherwise snap the size
    to the aspect-ratio bins of their 256-2048 px checkpoints, and clean the prompt (lower case, no URLs, ...)
    where bs4 and ftfy are installed, which training's encode_prompt never does (or log that they are missing,
    at every request); a Flux transformer without guidance embeddings takes the scale as `true_cfg_scale` where
    it guides by true CFG: unasked where it learned an unconditional prediction (true_cfg), else only for the
    call's `negative` prompt (without one, FluxPipeline's default: unguided)."""
    parameters = inspect.signature(pipeline.__call__).parameters
    options = {name: False for name in ("use_resolution_binning", "clean_caption") if name in parameters}
    if true_cfg(pipeline) or (negative is not None and guides_by_negative(pipeline)):
        options["true_cfg_scale"] = FLUX_SAMPLING_GUIDANCE if guidance_scale is None else guidance_scale
    return options
