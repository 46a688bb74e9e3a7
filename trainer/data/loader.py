"""Training batches from the shards: DataLoader workers build whole micro-batches, in step order.

Each worker opens the shards it touches and reads each sample with one read of its range
(trainer/data/shards.py), as trainer/data/plan.py places them. A sample that cannot be decoded is
replaced by another sample of the same bucket (chosen by a seeded generator, so still
deterministic), reported in the batch's `corrupt` list and never stops the job; a sample table that
does not describe its shard does (trainer/data/tables.py). A latent batch carries `latent_dist` and
`input_ids` (a UNet's) or a transformer family's stored embeddings (`prompt_embeds`, ...: trainer/data/latents.py)
where an image batch carries `pixel_values` and `caption` (trainer/objectives/diffusion.py takes either).
Caption dropout draws the same numbers for every kind of shard; a dropped caption is "", the empty
caption's token ids, or the empty caption's embeddings its latent shard opens with.
"""

import io
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from torch.utils.data import DataLoader, Dataset

from contracts.shard_members import CAPTION, EMPTY_CAPTION_KEY, IDS, IMAGE_FORMATS, LATENTS, RECORD, TEXT, member_name
from trainer.data.images import crop_to_bucket, decode_image
from trainer.data.latents import LatentShardsError, read_text, safetensors_metadata
from trainer.data.plan import BatchPlan
from trainer.data.shards import CorruptSample, ShardIndex, ShardIndexError, ShardReader, sample_source

MAX_REPLACEMENTS = 100  # a batch that meets this many corrupt samples in a row means broken data


class StepBatches(Dataset):
    """Item i is micro-batch i of the steps from `first_step` to `last_step`: a dict of tensors and lists."""

    def __init__(self, index: ShardIndex, plan: BatchPlan, first_step: int, last_step: int, caption_dropout: float,
                 random_crop: bool, empty_ids: np.ndarray | None = None, embeddings: bool = False):
        if index.latent and random_crop:
            raise ValueError("--random-crop needs image shards: a latent shard holds one (centred) crop per sample")
        if index.latent and not plan.aspect_buckets and not np.all(index.aspect == 1.0):
            raise ValueError("latent shards encoded with aspect buckets need --aspect-buckets true")
        if index.latent and caption_dropout and empty_ids is None and not embeddings:
            raise ValueError("caption dropout on latent shards needs the token ids of the empty caption")
        self.index, self.plan = index, plan
        self.first_step, self.last_step = first_step, last_step
        self.caption_dropout, self.random_crop, self.empty_ids = caption_dropout, random_crop, empty_ids
        self.embeddings = embeddings  # a family's latent shards: embeddings, and each shard's empty caption's
        self.reader = ShardReader(index)
        self._empty: dict[int, dict] = {}  # shard number -> its empty caption's embeddings, read once per process

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step + 1) * self.plan.accumulation

    def __getitem__(self, item: int) -> dict:
        step, micro = divmod(item, self.plan.accumulation)
        return self.batch(self.first_step + step, micro)

    def batch(self, step: int, micro: int) -> dict:
        slot = self.plan.slot(step, micro)
        rng = np.random.default_rng([self.plan.seed, self.plan.rank, slot.phase, slot.epoch, 1, slot.index])
        samples, corrupt = [], []
        for row in slot.samples:
            for _ in range(MAX_REPLACEMENTS):
                try:
                    samples.append(self.load(int(row), slot.bucket, rng))
                    break
                except CorruptSample as error:
                    corrupt.append(str(error))
                    row = rng.choice(slot.bucket_members)
            else:
                raise CorruptSample(f"{MAX_REPLACEMENTS} unreadable samples in a row in bucket {slot.bucket}: {corrupt[-3:]}")
        inputs = [name for name, value in samples[0].items() if isinstance(value, torch.Tensor)]
        return {
            **{name: torch.stack([sample[name] for sample in samples]) for name in inputs},
            "time_ids": torch.tensor([sample["time_ids"] for sample in samples], dtype=torch.float32),
            **({} if self.index.latent else {"caption": [sample["caption"] for sample in samples]}),
            "key": [sample["key"] for sample in samples],
            "shard": [sample["shard"] for sample in samples],
            "source": [sample["source"] for sample in samples],  # (partner, license): the trainer counts draws
            "corrupt": corrupt,
            "step": step,
            "stage": slot.phase,
            "epoch": slot.epoch,
        }

    def load(self, row: int, bucket: tuple[int, int], rng: np.random.Generator) -> dict:
        """One sample: decoded, scaled to cover the bucket and cropped, with its SDXL size/crop ids
        (image shards), or its stored posterior, time ids and token ids (latent shards)."""
        index = self.index
        shard, key = index.shards[index.shard[row]], str(index.key[row])
        offset = (rng.random(), rng.random()) if self.random_crop else (0.5, 0.5)
        drop_caption = rng.random() < self.caption_dropout  # the same draws for either kind of shard
        empty = self.empty_text(int(index.shard[row])) if self.embeddings and drop_caption else None
        try:
            members = self.read(row)
            source = sample_source(members.get(RECORD))
            if index.latent:
                tensors = load_safetensors(members[LATENTS])
                loaded = {"latent_dist": tensors["latent_dist"], "time_ids": tensors["time_ids"].tolist()}
                if self.embeddings:
                    loaded.update(empty if drop_caption else read_text(members[TEXT]))
                else:
                    ids = self.empty_ids if drop_caption else np.load(io.BytesIO(members[IDS]))
                    loaded["input_ids"] = torch.from_numpy(np.array(ids, dtype=np.int64))
            else:
                extension = next(extension for extension in IMAGE_FORMATS if extension in members)
                pixel_values, time_ids = crop_to_bucket(decode_image(members[extension], IMAGE_FORMATS[extension]), bucket, offset)
                loaded = {"pixel_values": pixel_values, "time_ids": time_ids,
                          "caption": "" if drop_caption else members[CAPTION].decode("utf-8")}
        except ShardIndexError:
            raise  # a sample table that lies about its shard: never a sample to replace
        except Exception as error:  # noqa: BLE001 - a bad member of any kind is skipped, never fatal
            raise CorruptSample(f"{Path(shard).name}/{key}: {type(error).__name__}: {error}") from None
        return {**loaded, "key": key, "shard": Path(shard).name, "source": source}

    def empty_text(self, number: int) -> dict:
        """The empty caption's embeddings that shard `number` opens with (trainer/data/latents.py)."""
        if number not in self._empty:
            name, data = self.reader.read_head(number)
            if name != member_name(EMPTY_CAPTION_KEY, TEXT) or \
                    safetensors_metadata(data).get("encoder") not in {encoder for encoder, _ in self.index.encodings}:
                raise LatentShardsError(f"{self.index.shards[number]} does not open with the empty caption's embeddings "
                                        f"of its encoder ({name!r}): encode its image shard again")
            self._empty[number] = read_text(data)
        return self._empty[number]

    def read(self, row: int) -> dict[str, bytes]:
        """The members of a row's sample, read by offset: lower-case extension -> bytes."""
        return self.reader.read(row)


def make_loader(batches: StepBatches, num_workers: int, pin_memory: bool | None = None) -> DataLoader:
    """The micro-batches in step order, built by `num_workers` processes (each takes whole batches);
    in pinned memory when there is a GPU to copy them to, unless `pin_memory` says otherwise."""
    return DataLoader(
        batches,
        batch_size=None,  # items are whole batches
        shuffle=False,
        num_workers=num_workers,
        prefetch_factor=4 if num_workers else None,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        generator=torch.Generator(),  # never draws from the training process's global RNG
    )
