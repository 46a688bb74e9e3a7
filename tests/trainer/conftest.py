"""Shards in the architecture.md layout, and one tiny training run the trainer tests share."""

import hashlib
import io
import json
import random
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from trainer.jobs import train

# (format, Pillow format, size): odd sizes and aspect ratios exercise the resize and crop.
IMAGE_KINDS = [("jpg", "JPEG", (80, 48)), ("png", "PNG", (40, 72)), ("webp", "WEBP", (64, 64))]


def make_sample(index: int) -> dict:
    """One sample: a random image, its caption and metadata, keyed by the image's sha256."""
    extension, pil_format, size = IMAGE_KINDS[index % len(IMAGE_KINDS)]
    rng = random.Random(index)
    image = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format)
    data = buffer.getvalue()
    sha256 = hashlib.sha256(data).hexdigest()
    caption = f"a red dog number {index}"
    metadata = {"sha256": sha256, "partner": "partner-a", "format": extension, "caption": caption,
                "width": size[0], "height": size[1], "license": "cc-by-4.0"}
    return {"key": sha256, "extension": extension, "image": data, "caption": caption, "metadata": metadata}


def _write_shard(path: Path, samples: list[dict]) -> None:
    """A tar as PackFunction writes it: members sorted by key, mtime 0, uid/gid 0, mode 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in sorted(samples, key=lambda s: s["key"]):
            members = [
                (sample["extension"], sample["image"]),
                ("json", json.dumps(sample["metadata"]).encode()),
                ("txt", sample["caption"].encode()),
            ]
            for extension, data in members:
                info = tarfile.TarInfo(f"{sample['key']}.{extension}")
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def write_shard():
    """write_shard(path, samples): a shard in the packer's layout."""
    return _write_shard


@pytest.fixture(scope="session")  # a pure function: module-scoped runs can use it too
def train_args():
    """train_args(train_dir, model_dir, checkpoint_dir, *extra): parsed arguments for a tiny CPU run."""
    return _train_args


@pytest.fixture(scope="session")
def samples() -> list[dict]:
    return [make_sample(index) for index in range(6)]


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, samples) -> Path:
    """Two shards of three samples, one of them a level down: the trainer searches recursively."""
    root = tmp_path_factory.mktemp("channel-train")
    _write_shard(root / "shard-a.tar", samples[:3])
    _write_shard(root / "nested" / "shard-b.tar", samples[3:])
    return root


def _train_args(train_dir: Path, model_dir: Path, checkpoint_dir: Path, *extra: str):
    """Arguments for a tiny CPU run: 32 px images, batches of 2, no DataLoader workers."""
    return train.parse_args([
        "--train-dir", str(train_dir),
        "--model-dir", str(model_dir),
        "--checkpoint-dir", str(checkpoint_dir),
        "--model-config", "tiny",
        "--resolution", "32",
        "--batch-size", "2",
        "--num-workers", "0",
        "--log-every", "1",
        "--validation-prompts", "",
        "--validation-inference-steps", "2",
        *extra,
    ])


@pytest.fixture(scope="session")
def trained(tmp_path_factory, shards_dir):
    """Three steps of the tiny model, checkpointed at step 2 and at the end (step 3)."""
    root = tmp_path_factory.mktemp("trained")
    args = _train_args(shards_dir, root / "model", root / "checkpoints", "--steps", "3", "--checkpoint-every", "2",
                       "--validation-prompts", "a red dog|a blue cat")
    record = train.main(args)
    return {"model_dir": root / "model", "checkpoint_dir": root / "checkpoints", "record": record}


def _encode_image(size: tuple[int, int], pil_format: str, seed: int) -> bytes:
    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(buffer, format=pil_format)
    return buffer.getvalue()


def _write_members(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar holding exactly these (name, bytes) members, in this order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def encode_image():
    """encode_image((width, height), pil_format, seed): the bytes of a random image."""
    return _encode_image


@pytest.fixture
def write_members():
    """write_members(path, [(name, bytes), ...]): a tar with exactly these members."""
    return _write_members


@pytest.fixture(scope="session")
def img2dataset_dir(tmp_path_factory) -> Path:
    """Two shards as img2dataset writes them: 9-digit keys, jpg/txt/json, parquet and stats beside."""
    root = tmp_path_factory.mktemp("img2dataset")
    for shard in range(2):
        members = []
        for number in range(3):
            key = f"{shard:05d}{number:04d}"
            size = (96, 64) if number % 2 else (64, 64)
            record = {"url": f"https://example.com/{key}.jpg", "key": key, "status": "success", "error_message": None,
                      "width": size[0], "height": size[1], "original_width": size[0] * 4, "original_height": size[1] * 4,
                      "exif": "{}", "sha256": "0" * 64, "caption": f"a green tree {key}"}
            members += [(f"{key}.jpg", _encode_image(size, "JPEG", int(key))),
                        (f"{key}.txt", record["caption"].encode()),
                        (f"{key}.json", json.dumps(record).encode())]
        _write_members(root / f"{shard:05d}.tar", members)
        (root / f"{shard:05d}.parquet").write_bytes(b"PAR1 not read by the trainer PAR1")
        (root / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 3, "successes": 3}))
    return root
