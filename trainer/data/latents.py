"""Latent shards: what one holds, and whose models and resolution it belongs to (the encode job,
trainer/jobs/encode.py, writes them; trainer/data/shards.py indexes them like image shards).

What a latent shard holds, per sample of the image shard (same key, same order, same relative path):
- `<key>.latents.safetensors`: `latent_dist`, the VAE's posterior parameters (mean and log-variance,
  [2 x latent channels, h, w], in the dtype the VAE ran in: bf16 on a GPU, fp32 on a CPU) for the
  sample's aspect bucket and centred crop at the resolution, exactly as trainer/data/shards.py +
  trainer/data/buckets.py prepare the image online; `time_ids` (SDXL's size and crop numbers); header
  metadata `encoder` (the identity), `resolution`, `bucket` ("WxH").
- `<key>.ids.npy`: the caption's token ids, int64 [text encoders, max length], what the online
  path's tokenizer gives.
- `<key>.json`: the sample's metadata record, unchanged (partner and license for the draw counts).
Storing the posterior rather than one sample of it keeps training identical to the online path:
the trainer draws the latents from it with each step's generator, so the same seed gives the same
latents, noise and loss from either kind of shard (tests/trainer/test_encode.py). Bit for bit where
the VAE gives a sample the same result in any batch: on the CPU for batches of two or more (a group
of one is encoded twice over for that reason); on a GPU cuDNN may pick other kernels for another
batch size, so there the posterior agrees to rounding, not bit for bit.

The identity is the sha256 of the VAE's, text encoders' and tokenizers' configs and weights (rounded
to bf16, so it is the same for the fp32 and the bf16 copy; the UNet is not part of it): another VAE
or text encoder means another directory, and the trainer refuses latent shards whose identity or
resolution is not its own (`check_latent_shards`).
"""

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from contracts.shard_members import IDS, LATENTS, RECORD, member_name
from trainer.data.shards import ShardIndex
from trainer.models.bundle import Models


class LatentShardsError(ValueError):
    """Latent shards that do not belong to this run's models or resolution."""


def models_identity(models: Models) -> str:
    """sha256 of the VAE's, text encoders' and tokenizers' configs and weights: what latent shards depend on."""
    digest = hashlib.sha256()
    for name, model in [("vae", models.vae), *((f"text_encoder_{n}", m) for n, m in enumerate(models.text_encoders))]:
        digest.update(f"{name}\n{model_config_json(model)}\n".encode())
        for key, tensor in sorted(model.state_dict().items()):
            # rounded to bf16: the same digest whether the frozen model is held in fp32 (CPU) or bf16 (GPU)
            tensor = tensor.detach().to("cpu", torch.bfloat16 if tensor.is_floating_point() else tensor.dtype).contiguous()
            digest.update(f"{key} {tuple(tensor.shape)}\n".encode())
            digest.update(tensor.view(torch.uint8).numpy())
    for number, tokenizer in enumerate(models.tokenizers):
        vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()))
        digest.update(f"tokenizer_{number} {tokenizer.model_max_length}\n{vocabulary}\n".encode())
    return digest.hexdigest()


def model_config_json(model: torch.nn.Module) -> str:
    """The model's architecture as canonical JSON: sorted keys, without the library's bookkeeping
    (diffusers' `_use_default_values` is a list made from a set, so its order changes from one
    process to the next, and the encode and the training job are two processes)."""
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    return json.dumps({k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"},
                      sort_keys=True, default=str)


def latent_dir(output_dir: str | Path, identity: str, resolution: int) -> Path:
    """Where the latent shards of these models at this resolution go."""
    return Path(output_dir) / f"{identity[:16]}-r{resolution}"


def check_latent_shards(index: ShardIndex, models: Models, resolutions: set[int], identity: str | None = None) -> None:
    """Latent shards must come from these models (`identity`, if already known), at the resolution of
    every phase that reads them."""
    if models.family is not None:
        raise LatentShardsError(f"latent shards carry UNet token ids; a {models.family.name} model trains on image shards "
                                "for now (its captions encoded by its own pipeline)")
    identity = identity or models_identity(models)
    for encoder, resolution in sorted(index.encodings):
        if encoder != identity:
            raise LatentShardsError(f"latent shards encoded by models {encoder[:16]}, not by this run's {identity[:16]}: "
                                    "encode the image shards again with these models (python -m trainer.jobs.encode)")
        if {resolution} != resolutions:
            raise LatentShardsError(f"latent shards at {resolution} px, but the run's phases are at {sorted(resolutions)} px")


def sample_members(key: str, latent_dist: torch.Tensor, time_ids: list[int], ids: torch.Tensor, record: bytes | None,
                   identity: str, resolution: int, bucket: tuple[int, int]) -> list[tuple[str, bytes]]:
    """One latent sample's members, in the order they are written."""
    latents = canonical_safetensors(save_safetensors(
        {"latent_dist": latent_dist.contiguous(), "time_ids": torch.tensor(time_ids, dtype=torch.int64)},
        metadata={"encoder": identity, "resolution": str(resolution), "bucket": f"{bucket[0]}x{bucket[1]}"}))
    ids_bytes = io.BytesIO()
    np.save(ids_bytes, ids.numpy().astype(np.int64), allow_pickle=False)
    members = [(member_name(key, IDS), ids_bytes.getvalue())]
    if record is not None:
        members.append((member_name(key, RECORD), record))
    return members + [(member_name(key, LATENTS), latents)]


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
