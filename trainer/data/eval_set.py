"""The evaluation's held-out samples: the eval channel's shards (the packer's layout, read with
trainer/data/shards.py's index), each sample's image a centred square, and the digest that names
the set in evaluation.json (trainer/jobs/evaluate.py; the autoencoder job reads its held-out PSNR
images here too).
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from wids.wids import IndexedTarSamples

from contracts.shard_members import IMAGE_FORMATS
from trainer.data.buckets import cover_and_crop
from trainer.data.images import decode_image, to_tensor
from trainer.data.scan import scan_shard


class EvaluationError(ValueError):
    """The evaluation cannot run as configured; the message says what is missing."""


@dataclass(frozen=True)
class EvalSample:
    key: str
    caption: str
    pixels: torch.Tensor  # [3, R, R] in [-1, 1]
    time_ids: list[int]  # SDXL's (original h, w, crop top, left, target h, w)


def find_eval_shards(eval_dir: str | None) -> list[Path]:
    """Every `*.tar` under the eval channel, sorted by path; EvaluationError when there is none."""
    if not eval_dir or not Path(eval_dir).is_dir():
        raise EvaluationError(f"the evaluation needs an `eval` channel of held-out shards; got {eval_dir!r}")
    shards = sorted(path for path in Path(eval_dir).rglob("*.tar") if path.is_file())
    if not shards:
        raise EvaluationError(f"no shards (*.tar) under the eval channel {eval_dir}")
    return shards


def eval_set_digest(eval_dir: str, shards: list[Path]) -> str:
    """sha256 over the sorted lines `<path in the channel>\\t<sha256 of the shard>\\n`."""
    lines = sorted(f"{shard.relative_to(eval_dir).as_posix()}\t{file_sha256(shard)}\n" for shard in shards)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_eval_samples(shards: list[Path], resolution: int, max_samples: int) -> tuple[list[EvalSample], list[str]]:
    """The first `max_samples` readable samples in shard order, centre-cropped squares; and what was skipped."""
    samples, problems = [], []
    for shard in shards:
        rows, shard_problems = scan_shard(str(shard))
        problems += shard_problems
        if not rows:
            continue
        reader = IndexedTarSamples(path=str(shard))
        try:
            for number, key, _ in rows:
                if len(samples) == max_samples:
                    return samples, problems
                try:
                    samples.append(load_sample(reader[number], key, resolution))
                except Exception as error:  # noqa: BLE001 - an undecodable sample is skipped, as in training
                    problems.append(f"{shard.name}/{key}: {type(error).__name__}: {error}")
        finally:
            reader.close()
    return samples, problems


def load_sample(members: dict, key: str, resolution: int) -> EvalSample:
    """One sample's image as a centred square of `resolution`, and its caption."""
    members = {extension[1:].lower(): data.getvalue() for extension, data in members.items() if extension != "__key__"}
    extension = next(extension for extension in IMAGE_FORMATS if extension in members)
    image = decode_image(members[extension], IMAGE_FORMATS[extension])
    width, height = image.size
    resized, (left, top) = cover_and_crop(width, height, (resolution, resolution), (0.5, 0.5))
    image = image.resize(resized, Image.Resampling.BICUBIC).crop((left, top, left + resolution, top + resolution))
    return EvalSample(key, members["txt"].decode("utf-8"), to_tensor(image), [height, width, top, left, resolution, resolution])
