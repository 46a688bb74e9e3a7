"""Encode image shards into latent shards once, so training runs the denoiser alone.

Runbook
-------
One process (CPU, or one GPU when there is one):

    python -m trainer.jobs.encode --train-dir shards/ --output-dir latents/ --resolution 512 --model-config sd2

writes `latents/<identity>-r512/<the same relative shard paths>` and each latent shard's sample table
`latents/<identity>-r512/indexes/<shard id>.table`; train on that directory with
`python -m trainer.jobs.train --train-dir latents/<identity>-r512 --resolution 512 ...` and the same
`--model-config`/`--pretrained` and `--seed` (random init) as the encode job.

SageMaker: a training job with the training image and the hyperparameter `task=encode` (channel
`train`: the image shards; `indexes`, their sample tables; channel `manifest`, when the manifest
excludes samples: the training job's own; the other hyperparameters are this script's arguments). It writes under
`/opt/ml/checkpoints/latents/`, which CheckpointConfig uploads object by object to
`<CheckpointConfig.S3Uri>/latents/<identity>-r<resolution>/...` while the job runs; that S3 prefix
is the next training job's `train` channel. A retried job gets its finished shards back from the
same CheckpointConfig and skips them.

Exclusions (docs/provenance.md): samples the manifest's `exclude` lists (`--manifest`, default
$SM_CHANNEL_MANIFEST) are dropped while indexing, exactly as trainer/data/shards.py does for training:
never read or decoded, and absent from the latent shard, which then holds fewer samples than its
image shard. The trainer applies the same list to the latent shards again (same keys, same shard ids).

What a latent shard holds, and the identity of the models that wrote it: trainer/data/latents.py. For a
transformer family (`--model-config tiny-sd3`, a `--pretrained` SD3 or PixArt pipeline) the main thread
also runs the family's `encode_prompt` on each group's captions, and every shard gets the empty caption's
embeddings first; the summary's `text_s` is the time that took (bench/encode_text.py measures it). Its
`captions_cut` counts, per tokenizer, the captions longer than its context, which truncation cuts (a
pretrained tokenizer's too, which no tokenizer job measured).

Who does what, so that the GPU is never waiting on Python: the loader's worker processes read,
decode, crop and tokenize; the main thread only hands the pixels to the VAE and queues the copy of
its latents to pinned host memory, without waiting for it; one writer thread (`ShardWriter`) waits
for each copy, serialises the samples and writes the tars. A thread, not a process: it reads the
pinned copy itself, with nothing to send anywhere, and it only has to keep pace with the VAE. Its
queue holds a few batches at most, so memory stays bounded and a slow disk slows the main thread
instead; an error in it fails the job from the main thread.
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from contracts.recipe_jobs import EncodeOptions
from contracts.s3_layout import INDEXES
from contracts.shard_members import CAPTION, IMAGE_FORMATS, RECORD
from trainer.data.images import crop_to_bucket, decode_image
from trainer.data.latents import empty_caption_member, latent_dir, models_identity, stored_text
from trainer.data.buckets import check_resolution
from trainer.data.plan import buckets_of
from trainer.data.captions import read_captions
from trainer.data.shards import CorruptSample, ShardIndex, ShardIndexError, ShardReader, index_shards, load_exclusions
from trainer.jobs.hyperparameters import add_options, checked
from trainer.jobs.latent_writer import ShardWriter
from trainer.models.bundle import Models
from trainer.models.families import Conditioning, condition
from trainer.models.loading import load_models, preset_geometry
from trainer.models.text import token_ids
from trainer.models.text_tokenizers import UNET_TEXT_PARTS, as_seen
from trainer.models.tokenizer import captions_cut
from trainer.objectives.numerics import autocast
from trainer.runtime import distributed
from trainer.speed.vae_compile import compile_vae_encoder


# ---------------------------------------------------------------- reading images


class ImageGroups(Dataset):
    """Item i: a group of samples of one shard and one bucket, decoded and cropped as the trainer does
    online, with their captions and their token ids (the tokenizers, if any, run in the loader's workers,
    beside the GPU; a transformer family's pipeline tokenizes on its own), and how many captions each of
    `counted` (tokenizers by pipeline subfolder) cuts at its context, as the pipeline hands them over."""

    def __init__(self, index: ShardIndex, groups: list[tuple[tuple[int, int], list[int]]], tokenizers: list,
                 counted: dict | None = None, lowercase: bool = False):
        self.index, self.groups, self.tokenizers, self.reader = index, groups, tokenizers, ShardReader(index)
        self.counted, self.lowercase = counted or {}, lowercase

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, item: int) -> dict:
        bucket, rows = self.groups[item]
        loaded, corrupt = [], []
        for row in rows:
            key = str(self.index.key[row])
            try:
                members = self.reader.read(row)
                extension = next(extension for extension in IMAGE_FORMATS if extension in members)
                pixels, time_ids = crop_to_bucket(decode_image(members[extension], IMAGE_FORMATS[extension]), bucket, (0.5, 0.5))
                loaded.append((row, pixels, time_ids, members[CAPTION].decode("utf-8"), members.get(RECORD)))
            except ShardIndexError:
                raise  # a sample table that lies about its shard stops the job (trainer/data/tables.py)
            except Exception as error:  # noqa: BLE001 - a bad member of any kind is left out, never fatal
                corrupt.append(str(CorruptSample(f"{Path(self.index.shards[self.index.shard[row]]).name}/{key}: "
                                                 f"{type(error).__name__}: {error}")))
        return {"bucket": bucket, "rows": [entry[0] for entry in loaded],
                "pixel_values": torch.stack([entry[1] for entry in loaded]) if loaded else None,
                "time_ids": [entry[2] for entry in loaded],
                "ids": token_ids(self.tokenizers, [entry[3] for entry in loaded]) if loaded and self.tokenizers else None,
                "captions": [entry[3] for entry in loaded],
                "cut": {name: captions_cut(tokenizer, as_seen([entry[3] for entry in loaded], self.lowercase))
                        for name, tokenizer in self.counted.items()},
                "records": [entry[4] for entry in loaded], "corrupt": corrupt}


def groups_of(index: ShardIndex, assignment: np.ndarray, sizes: list, batch_size: int) -> list[tuple[int, list]]:
    """(shard number, [(bucket, rows)]) per shard: its samples by bucket, cut into batches."""
    by_shard = []
    for shard in range(len(index.shards)):
        rows = np.flatnonzero(index.shard == shard)
        groups = []
        for bucket in np.unique(assignment[rows]):
            members = rows[assignment[rows] == bucket].tolist()
            groups += [(sizes[bucket], members[i:i + batch_size]) for i in range(0, len(members), batch_size)]
        by_shard.append((shard, groups))
    return by_shard


# ---------------------------------------------------------------- encoding


def to_host(latents: torch.Tensor, text: dict[str, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, dict | None, torch.cuda.Event | None]:
    """The latents (and a family's `text` embeddings) on the CPU, and the event after which they are there
    (None: they are already).

    From a GPU, copies into pinned memory queued behind the kernels, so the main thread does not
    wait for them; the event blocks rather than spins, leaving the CPU to the loader's workers."""
    if latents.device.type == "cpu":
        return latents, text, None
    hosts = {}
    for name, tensor in {"": latents, **(text or {})}.items():
        hosts[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        hosts[name].copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event(blocking=True)
    copied.record()
    return hosts.pop(""), hosts if text is not None else None, copied


def caption_conditioning(models: Models, captions: list[str], device: torch.device) -> Conditioning:
    """A transformer family's conditioning of `captions`: exactly the online path's call
    (trainer/objectives/diffusion.py)."""
    with torch.no_grad(), autocast(device):
        return condition(models.family, models.text_pipeline(), captions, device)


def caption_embeddings(models: Models, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """`caption_conditioning` by the names its pipeline gives them, cut and cast on its device as the text
    members store it (`stored_text`), so only that crosses to the host."""
    conditioning = caption_conditioning(models, captions, device)
    return stored_text(conditioning.tensors(), conditioning.positions)


def encode_shards(train_dir: str | Path, output_dir: str | Path, models: Models, resolution: int, device: torch.device,
                  batch_size: int = 16, num_workers: int = 2, aspect_buckets: bool = True, identity: str | None = None,
                  exclude: Mapping[str, Collection[str]] | None = None, padded: bool = False,
                  index_dir: str | Path | None = None) -> dict:
    """Encode every image shard under `train_dir`, less `exclude` (shard id -> sample keys, never
    read), into `latent_dir(output_dir, ...)`; a summary of the work, with the seconds the main thread
    waited on the loader's workers and on the writer (`loader_wait_s`, `writer_wait_s`): what bounds it.

    `models` are on `device` already (bf16 VAE on a GPU, models.frozen_to); shards already there are kept.
    `padded`: every VAE call takes `batch_size` images, a short group filled up with copies of its
    last image whose latents are dropped, so a compiled encoder sees one shape per bucket.
    `index_dir`: the image shards' sample tables (trainer/data/shards.py); each latent shard gets its
    own, in `<the latent dir>/indexes/`.
    """
    started = time.perf_counter()
    identity = identity or models_identity(models)
    target = latent_dir(output_dir, identity, resolution)
    index = index_shards(train_dir, exclude=exclude, index_dir=index_dir)
    if index.latent:
        raise ValueError(f"{train_dir} holds latent shards already")
    family = models.family is not None  # its embeddings are stored, and every shard opens with the empty caption's
    head = [empty_caption_member({name: tensor[0].cpu() for name, tensor in caption_embeddings(models, [""], device).items()},
                                 identity)] if family else []
    sizes, assignment = buckets_of(index.aspect, resolution, models.size_multiple, aspect_buckets)
    outputs = {shard: target / Path(path).relative_to(Path(train_dir)) for shard, path in enumerate(index.shards)}
    work = [(shard, groups) for shard, groups in groups_of(index, assignment, sizes, batch_size) if not outputs[shard].is_file()]
    flat = [group for _, groups in work for group in groups]
    shard_of_group = [shard for shard, groups in work for _ in groups]
    names = [folder for _, folder in models.text_folders] if family else [folder for _, folder in UNET_TEXT_PARTS]
    counted = dict(zip(names, models.tokenizers))  # captions longer than each tokenizer's context
    lowercase = family and models.family.lowercases_prompts
    loader = DataLoader(ImageGroups(index, flat, [] if family else models.tokenizers, counted, lowercase),
                        batch_size=None, num_workers=num_workers,
                        prefetch_factor=4 if num_workers else None, pin_memory=device.type == "cuda")
    groups_left = defaultdict(int)
    for shard in shard_of_group:
        groups_left[shard] += 1
    corrupt, encoded = list(index.problems), 0
    waited = {"loader": 0.0, "writer": 0.0}  # the main thread blocked on the workers, on the writer: what bounds it
    text_s = 0.0  # the main thread in the family's encode_prompt
    cut = dict.fromkeys(counted, 0)
    with ShardWriter(outputs, identity, resolution, target / INDEXES, head=head) as writer:
        groups = iter(loader)
        for shard in shard_of_group:
            asked = time.perf_counter()
            group = next(groups)
            waited["loader"] += time.perf_counter() - asked
            corrupt += group["corrupt"]
            for name, count in group["cut"].items():
                cut[name] += count
            if group["rows"]:
                pixel_values = group["pixel_values"]
                if padded and len(pixel_values) < batch_size:
                    pixel_values = pad_batch(pixel_values, batch_size)
                elif len(pixel_values) == 1:  # never a batch of one: the CPU's conv kernels take another path for it
                    pixel_values = pixel_values.repeat(2, 1, 1, 1)
                with torch.no_grad(), autocast(device):  # exactly the online path's call (trainer/objectives/diffusion.py)
                    pixel_values = pixel_values.to(device, non_blocking=True)
                    parameters = models.vae.encode(pixel_values.to(models.vae.dtype)).latent_dist.parameters
                text = None
                if family:
                    asked = time.perf_counter()
                    text = caption_embeddings(models, group["captions"], device)
                    text_s += time.perf_counter() - asked
                latents, text, copied = to_host(parameters[:len(group["rows"])], text)
                asked = time.perf_counter()
                writer.add(shard, [str(index.key[row]) for row in group["rows"]], group, latents, copied, text)
                waited["writer"] += time.perf_counter() - asked
                encoded += len(group["rows"])
            groups_left[shard] -= 1
            if groups_left[shard] == 0:
                writer.finish(shard)
    return {"identity": identity, "resolution": resolution, "dir": str(target), "shards": len(index.shards),
            "shards_written": len(work), "samples_encoded": encoded, "samples_excluded": index.excluded, "corrupt": corrupt,
            "seconds": round(time.perf_counter() - started, 2), "padded": padded,
            "loader_wait_s": round(waited["loader"], 2), "writer_wait_s": round(waited["writer"], 2),
            "captions_cut": cut, **({"text_s": round(text_s, 2)} if family else {})}


def pad_batch(pixel_values: torch.Tensor, size: int) -> torch.Tensor:
    """`size` images: these, then their last one repeated (each image's latent depends on it alone)."""
    filler = pixel_values[-1:].expand(size - len(pixel_values), *pixel_values.shape[1:])
    return torch.cat([pixel_values, filler])


# ---------------------------------------------------------------- main


def main(args: argparse.Namespace) -> dict:
    processes = distributed.setup()
    if processes.world_size > 1:
        raise ValueError("trainer.jobs.encode runs as one process (SageMaker: one host, or ShardedByS3Key across hosts)")
    print(json.dumps({"event": "imported"}), flush=True)  # the job's fixed costs show in its log
    if not args.pretrained:  # a preset's resolution is checked first: learning its tokenizers reads the shards
        check_resolution(args.resolution or preset_geometry(args.model_config)[1], preset_geometry(args.model_config)[0])
    models = load_models(args.model_config, args.pretrained, args.seed, args.vae, tokenizer=args.tokenizer,
                         captions=lambda: read_captions(args.train_dir, args.manifest, args.index_dir))
    identity = models_identity(models)
    models.frozen_to(processes.device)
    print(json.dumps({"event": "models", "identity": identity}), flush=True)
    resolution = check_resolution(args.resolution or models.default_resolution, models.size_multiple)  # before any shard
    compiling = args.compile if args.compile != "auto" else processes.device.type == "cuda"
    if compiling:  # one graph per bucket shape, since every call is padded to the batch size
        compile_vae_encoder(models)
    summary = encode_shards(args.train_dir, args.output_dir, models, resolution, processes.device, args.batch_size,
                            args.num_workers, args.aspect_buckets, identity, load_exclusions(args.manifest),
                            padded=compiling, index_dir=args.index_dir)
    (Path(summary["dir"]) / "encoding.json").write_text(json.dumps({**summary, "args": vars(args)}, indent=2) + "\n")
    print(json.dumps({"event": "encoded", **{k: v for k, v in summary.items() if k != "corrupt"},
                      "corrupt_samples": len(summary["corrupt"])}), flush=True)
    distributed.teardown()
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Encode image shards into latent shards for one resolution.")
    parser.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                        help="the image shards (default $SM_CHANNEL_TRAIN)")
    parser.add_argument("--manifest", default=env.get("SM_CHANNEL_MANIFEST"),
                        help="the job's manifest JSON (or the channel dir holding it): its `exclude` samples are never "
                             "read nor encoded (default $SM_CHANNEL_MANIFEST)")
    parser.add_argument("--index-dir", default=env.get("SM_CHANNEL_INDEXES"),
                        help="the shards' sample tables (default $SM_CHANNEL_INDEXES, else <train-dir>/indexes)")
    parser.add_argument("--output-dir", required=True, help="latent shards go to <output-dir>/<identity>-r<resolution>/")
    add_options(parser, EncodeOptions)  # the recipe (contracts.recipe_jobs); the paths above are not in it
    return checked(parser, EncodeOptions, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
