"""Latent shards: what one holds, and whose models and resolution it belongs to (the encode job,
trainer/jobs/encode.py, writes them; trainer/data/shards.py indexes them like image shards).

What a latent shard holds, per sample of the image shard (same key, same order, same relative path):
- `<key>.latents.safetensors`: `latent_dist`, the VAE's posterior parameters (mean and log-variance,
  [2 x latent channels, h, w], in the dtype the VAE ran in: bf16 on a GPU, fp32 on a CPU) for the
  sample's aspect bucket and centred crop at the resolution, exactly as trainer/data/shards.py +
  trainer/data/buckets.py prepare the image online; `time_ids` (SDXL's size and crop numbers); header
  metadata `encoder` (the identity), `resolution`, `bucket` ("WxH").
- the caption, as the denoiser's family takes it:
  - a UNet's: `<key>.ids.npy`, the caption's token ids, int64 [text encoders, max length], what the
    online path's tokenizer gives; the trainer's text encoders still run on them.
  - a transformer family's (trainer/models/families.py): `<key>.text.safetensors`, what the family's
    pipeline's `encode_prompt` gives for the caption, in bf16: `prompt_embeds` [tokens, width] and
    SD3's `pooled_prompt_embeds` [width], or PixArt's `prompt_embeds` and `prompt_attention_mask` [tokens]
    (int64, as the tokenizer gives it). Where there is a mask, both are cut after its last kept position
    (a caption of 20 tokens stores 20 of PixArt's 300); the header's `tokens` is the full length, and the
    loader pads them back to it with zeros, masked out, so the transformer sees the shapes and, the
    masked positions weighing nothing, the values of the online path. SD3 attends to every position
    (T5's padding included, no mask), so its embeddings are stored whole. The trainer then loads no
    text encoder at all: a multi-billion-parameter T5 never sits in its memory.
- `<key>.json`: the sample's metadata record, unchanged (partner and license for the draw counts).
A family's latent shard opens with one member that is no sample, `_empty-caption.text.safetensors`
(contracts.shard_members.EMPTY_CAPTION_KEY): the empty caption's embeddings, in every shard, so that
any subset of the shards (ShardedByS3Key on several hosts, one rank's share) can drop captions for
classifier-free guidance (`--caption-dropout`) as the online path does, where a dropped caption is "".
The sample tables and the tar walk leave it out of the index.

Storing the posterior rather than one sample of it keeps training identical to the online path:
the trainer draws the latents from it with each step's generator, so the same seed gives the same
latents, noise and loss from either kind of shard (tests/trainer/test_encode.py). Bit for bit where
the VAE gives a sample the same result in any batch: on the CPU for batches of two or more (a group
of one is encoded twice over for that reason); on a GPU cuDNN may pick other kernels for another
batch size, so there the posterior agrees to rounding, not bit for bit. A family's embeddings agree to
bf16 rounding (tests/trainer/test_encode_families.py).

The identity is the sha256 of the VAE's config and weights (rounded to bf16, so it is the same for the
fp32 and the bf16 copy; the denoiser is not part of it), the text encoders' and the tokenizers'
vocabularies: another VAE or text encoder means another directory, and the trainer refuses latent
shards whose identity or resolution is not its own (`check_latent_shards`). A UNet's text encoders are
hashed as the VAE is. A transformer family's are hashed from their description, never instantiated,
since its training job loads none (`Models.text_origin`): from a base, each encoder folder's config (as
canonical JSON) and the sha256 of its every other file (the weights; a bf16 copy of an fp32 base is
another identity); from a preset, the configs as built, the seed and the torch and transformers
versions, which together fix the weights the CPU draws.
"""
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from contracts.shard_members import EMPTY_CAPTION_KEY, IDS, LATENTS, RECORD, TEXT, member_name
from trainer.data.shards import ShardIndex
from trainer.models.bundle import Models


class LatentShardsError(ValueError):
    """Latent shards that do not belong to this run's models or resolution."""


def models_identity(models: Models) -> str:
    """sha256 of the VAE's, text encoders' and tokenizers' configs and weights: what latent shards depend on."""
    digest = hashlib.sha256()
    encoders = [] if models.family is not None else models.text_encoders  # a family's: text_origin_digest
    for name, model in [("vae", models.vae), *((f"text_encoder_{n}", m) for n, m in enumerate(encoders))]:
        digest.update(f"{name}\n{model_config_json(model)}\n".encode())
        for key, tensor in sorted(model.state_dict().items()):
            # rounded to bf16: the same digest whether the frozen model is held in fp32 (CPU) or bf16 (GPU)
            tensor = tensor.detach().to("cpu", torch.bfloat16 if tensor.is_floating_point() else tensor.dtype).contiguous()
            digest.update(f"{key} {tuple(tensor.shape)}\n".encode())
            digest.update(tensor.view(torch.uint8).numpy())
    if models.family is not None:
        digest.update(f"{models.family.name} text encoders {text_origin_digest(models.text_origin)}\n".encode())
    for number, tokenizer in enumerate(models.tokenizers):
        digest.update(f"tokenizer_{number} {tokenizer.model_max_length}\n{tokenizer_state(tokenizer)}\n".encode())
    return digest.hexdigest()


def tokenizer_state(tokenizer) -> str:
    """What decides how a tokenizer splits text, as canonical JSON: its whole model (a vocabulary alone misses
    BPE merges and Unigram scores), normalizer and pre-tokenizer, without the truncation and padding state
    a call leaves behind."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without a `tokenizers` backend: its vocabulary is what there is
        return json.dumps(sorted(tokenizer.get_vocab().items()))
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    return json.dumps(state, sort_keys=True)


def text_origin_digest(origin: dict) -> str:
    """sha256 of a transformer family's text encoders from their description (`Models.text_origin`), without
    instantiating them: a base's folders (config as canonical JSON, every other file by the sha256 of its
    bytes), or a preset's configs as built with the seed and the versions of what draws the weights."""
    digest = hashlib.sha256()
    if "files" in origin:
        for folder, path in sorted(origin["files"].items()):
            for file in sorted(f for f in Path(path).rglob("*") if f.is_file() and not f.name.startswith(".")):
                name = file.relative_to(path).as_posix()
                if name == "config.json":
                    content = canonical_config(json.loads(file.read_text()))
                else:
                    with file.open("rb") as opened:
                        content = hashlib.file_digest(opened, "sha256").hexdigest()
                digest.update(f"{folder}/{name} {content}\n".encode())
    else:
        for folder, config in sorted(origin["built"].items()):
            digest.update(f"{folder} {canonical_config(config.to_dict())}\n".encode())
        digest.update(f"seed {origin['seed']} on the CPU, torch {torch.__version__}, "
                      f"transformers {transformers.__version__}\n".encode())
    return digest.hexdigest()


def model_config_json(model: torch.nn.Module) -> str:
    """The model's architecture as canonical JSON (`canonical_config`)."""
    return canonical_config(model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config))


def canonical_config(config: dict) -> str:
    """A config as canonical JSON: sorted keys, without the library's bookkeeping (diffusers'
    `_use_default_values` is a list made from a set, so its order changes from one process to the next,
    and the encode and the training job are two processes)."""
    return json.dumps({k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"},
                      sort_keys=True, default=str)


def latent_dir(output_dir: str | Path, identity: str, resolution: int) -> Path:
    """Where the latent shards of these models at this resolution go."""
    return Path(output_dir) / f"{identity[:16]}-r{resolution}"


def check_latent_shards(index: ShardIndex, models: Models, resolutions: set[int], identity: str | None = None) -> None:
    """Latent shards must come from these models (`identity`, if already known), at the resolution of
    every phase that reads them."""
    identity = identity or models_identity(models)
    for encoder, resolution in sorted(index.encodings):
        if encoder != identity:
            raise LatentShardsError(f"latent shards encoded by models {encoder[:16]}, not by this run's {identity[:16]} "
                                    "(another VAE, text encoder or tokenizer): encode the image shards again with "
                                    "these models (python -m trainer.jobs.encode)")
        if {resolution} != resolutions:
            raise LatentShardsError(f"latent shards at {resolution} px, but the run's phases are at {sorted(resolutions)} px")


def sample_members(key: str, latent_dist: torch.Tensor, time_ids: list[int], ids: torch.Tensor | None,
                   record: bytes | None, identity: str, resolution: int, bucket: tuple[int, int],
                   text: dict[str, torch.Tensor] | None = None) -> list[tuple[str, bytes]]:
    """One latent sample's members, in the order they are written: with its token `ids` (a UNet's), or
    with its `text` embeddings by name (a transformer family's, `text_member`)."""
    latents = canonical_safetensors(save_safetensors(
        {"latent_dist": latent_dist.contiguous(), "time_ids": torch.tensor(time_ids, dtype=torch.int64)},
        metadata={"encoder": identity, "resolution": str(resolution), "bucket": f"{bucket[0]}x{bucket[1]}"}))
    members = []
    if text is None:
        ids_bytes = io.BytesIO()
        np.save(ids_bytes, ids.numpy().astype(np.int64), allow_pickle=False)
        members.append((member_name(key, IDS), ids_bytes.getvalue()))
    if record is not None:
        members.append((member_name(key, RECORD), record))
    members.append((member_name(key, LATENTS), latents))
    return members + ([(member_name(key, TEXT), text_member(text, identity))] if text is not None else [])


EMBEDS, MASK = "prompt_embeds", "prompt_attention_mask"  # trainer.models.families.STORED_NAMES' token-wise parts


def stored_text(tensors: dict[str, torch.Tensor], positions: int | None) -> dict[str, torch.Tensor]:
    """A batch of encode_prompt's tensors as its text members keep them, where they are (on a GPU: before
    the copy to the host, a few percent of the padded size for short captions): floating point in bf16,
    the embeddings cut after the batch's first `positions` (the rest is zero padding; None: uncut). The
    mask stays whole: its length is the full one, which `text_member` records and `read_text` pads to."""
    return {name: (tensor[:, :positions] if name == EMBEDS and positions is not None else tensor)
            .to(torch.bfloat16 if tensor.is_floating_point() else tensor.dtype) for name, tensor in tensors.items()}


def text_member(tensors: dict[str, torch.Tensor], identity: str) -> bytes:
    """One caption's conditioning (one sample's rows of encode_prompt's tensors, by name, or of
    `stored_text`'s) as a safetensors member: floating point in bf16, the mask as it is, the token-wise parts
    cut after the mask's last kept position; header metadata `encoder` (the identity) and `tokens` (the full
    length, the mask's where there is one, to pad back to)."""
    mask = tensors.get(MASK)
    tokens = tensors[EMBEDS].shape[0] if mask is None else mask.shape[0]
    kept = tokens if mask is None else int(mask.nonzero().max()) + 1 if mask.any() else 1
    stored = {name: (tensor[:kept] if name in (EMBEDS, MASK) else tensor) for name, tensor in tensors.items()}
    stored = {name: (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
              for name, tensor in stored.items()}
    return canonical_safetensors(save_safetensors(stored, metadata={"encoder": identity, "tokens": str(tokens)}))


def empty_caption_member(tensors: dict[str, torch.Tensor], identity: str) -> tuple[str, bytes]:
    """The member a family's latent shard opens with: the empty caption's `text_member`."""
    return member_name(EMPTY_CAPTION_KEY, TEXT), text_member(tensors, identity)


def read_text(data: bytes) -> dict[str, torch.Tensor]:
    """A text member's tensors, the token-wise parts padded back to their full length with zeros (masked out)."""
    tensors = load_safetensors(data)
    missing = int(safetensors_metadata(data)["tokens"]) - tensors[EMBEDS].shape[0]
    if missing:
        tensors[EMBEDS] = F.pad(tensors[EMBEDS], (0, 0, 0, missing))
        tensors[MASK] = F.pad(tensors[MASK], (0, missing))
    return tensors


def safetensors_metadata(data: bytes) -> dict:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]).get("__metadata__", {})


def canonical_safetensors(data: bytes) -> bytes:
    """The same file with its `__metadata__` keys sorted, so one encode always gives the same bytes.

    safetensors writes the metadata map in a hash order that changes from call to call; the tensors
    are bit-identical. Sorting keeps the header's length (the same JSON, reordered), so the data
    offsets and the padding to 8 bytes hold as they are."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:  # cannot happen for a reordering; never write a header that does not fit
        raise ValueError("the canonical safetensors header is longer than the original")
    return data[:8] + text.ljust(length, b" ") + data[8 + length:]
