"""Training samples from the shards in a channel directory: the only code that knows the shard layout.

A shard is a tar of samples, each three members sharing the key `<sha256>`: the image
(`.jpg`, `.png` or `.webp`, the uploaded bytes), `.txt` (the caption) and `.json` (the metadata
record, unused here). See "Shards" in docs/architecture.md.
"""

import io
import itertools
import os
from functools import partial
from pathlib import Path

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

IMAGE_MEMBERS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}  # member extension -> Pillow format
SHUFFLE_BUFFER = 1000  # samples held (still encoded) to mix neighbours from different shards


class NoShardsError(ValueError):
    """The channel directory holds no shard this process can read."""


def find_shards(channel_dir: str | Path) -> list[str]:
    """Every `*.tar` under the channel, at any depth, in a stable order."""
    root = Path(channel_dir)
    shards = sorted(str(path) for path in root.rglob("*.tar") if path.is_file())
    if not shards:
        raise NoShardsError(f"no shards (*.tar) under the training channel {root}")
    return shards


def local_process() -> tuple[int, int]:
    """(this process's index, process count) on this host, as torchrun sets them."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def split_by_local_rank(shards):
    """Each process on this host reads every n-th shard.

    SageMaker's ShardedByS3Key has already given each host its own shards, so the split is between
    the processes of one host, not by global rank as `wds.split_by_node` would do.
    """
    rank, world_size = local_process()
    yield from itertools.islice(shards, rank, None, world_size)


def make_loader(channel_dir: str | Path, resolution: int, batch_size: int, seed: int, num_workers: int) -> DataLoader:
    """An endless stream of batches {"pixel_values", "caption", "key", "shard"} from the channel."""
    shards = find_shards(channel_dir)
    _, processes = local_process()
    per_process = len(shards) // processes
    if per_process == 0:
        raise NoShardsError(f"{len(shards)} shard(s) under {channel_dir} for {processes} processes: need one each")
    dataset = (
        wds.WebDataset(
            shards,
            shardshuffle=len(shards),
            detshuffle=True,  # seeded by (seed, pass over the data): a new shard order every pass
            seed=seed,
            nodesplitter=split_by_local_rank,
            workersplitter=wds.split_by_worker,
        )
        .shuffle(SHUFFLE_BUFFER, seed=seed)
        .map(partial(to_training_sample, resolution=resolution))
        .repeat()  # training is counted in steps, not epochs
    )
    # A DataLoader worker without a shard would yield nothing; give each at least one.
    workers = min(num_workers, per_process)
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=torch.cuda.is_available())


def to_training_sample(sample: dict, resolution: int) -> dict:
    """One webdataset sample (encoded members) -> a pixel tensor in [-1, 1] and its caption."""
    key, shard = sample["__key__"], Path(sample["__url__"]).name
    present = [ext for ext in IMAGE_MEMBERS if ext in sample]
    if not present or "txt" not in sample:
        raise ValueError(f"sample {key} in {shard} needs an image (jpg/png/webp) and a txt member; has {sorted(sample)}")
    image = decode_image(sample[present[0]], IMAGE_MEMBERS[present[0]])
    return {
        "pixel_values": to_tensor(resize_and_crop(image, resolution)),
        "caption": sample["txt"].decode("utf-8"),
        "key": key,
        "shard": shard,
    }


def decode_image(data: bytes, pil_format: str) -> Image.Image:
    """The member's bytes as an RGB image; Pillow's decompression-bomb guard stays on."""
    with Image.open(io.BytesIO(data), formats=[pil_format]) as image:
        return image.convert("RGB")


def resize_and_crop(image: Image.Image, resolution: int) -> Image.Image:
    """Shorter side to `resolution`, then the centred square: no stretching."""
    scale = resolution / min(image.size)
    width, height = (max(resolution, round(side * scale)) for side in image.size)
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = (width - resolution) // 2, (height - resolution) // 2
    return image.crop((left, top, left + resolution, top + resolution))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as a float tensor [3, H, W] scaled to [-1, 1], the VAE's input range."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0
