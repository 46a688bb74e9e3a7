"""Partner traffic for the local stack: the chaos test (tests/e2e/test_chaos.py) and the load
benchmark (bench/load.py) upload distinct generated pictures of mixed formats and sizes, wait until
the pipeline is quiet, and read every sealed shard back.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from contracts import pipeline_table
from contracts.messages import ShardSealed
from core import aws

FORMATS = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))


@dataclass(frozen=True)
class Upload:
    key: str
    body: bytes
    sidecar: dict[str, str] | None = None


def picture(rng: random.Random, side: int) -> Image.Image:
    """Random shapes on a random ground: distinct pictures (and perceptual hashes) for any seed."""
    ratio = rng.uniform(0.75, 1.33)
    image = Image.new("RGB", (side, max(64, int(side * ratio))), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 8)):
        x0, y0 = rng.randrange(image.width), rng.randrange(image.height)
        x1, y1 = x0 + rng.randint(8, image.width // 2), y0 + rng.randint(8, image.height // 2)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 85} if fmt != "PNG" else {}))
    return buffer.getvalue()


def uploads(partner: str, count: int, seed: int, large_share: float = 0.0, sidecar_share: float = 0.3,
            prefix: str = "") -> list[Upload]:
    """`count` distinct images of the three formats, 64..256 px, `large_share` of them 1,024..1,600 px
    photos-in-spirit (larger bytes, still under STORE_MAX_SIDE); some with a caption/license sidecar."""
    rng = random.Random(seed)
    made = []
    for n in range(count):
        extension, fmt = FORMATS[n % len(FORMATS)]
        side = rng.randint(1024, 1600) if rng.random() < large_share else rng.randint(64, 256)
        sidecar = ({"caption": f"picture {seed}-{n}", "license": "CC-BY-4.0", "source": "generated"}
                   if rng.random() < sidecar_share else None)
        made.append(Upload(f"{partner}/{prefix}{seed}/{n:05d}.{extension}", encode(picture(rng, side), fmt), sidecar))
    return made


def put(bucket: str, upload: Upload) -> None:
    """Sidecar first, as `atelier upload` does, so its image's event finds it."""
    s3 = aws.client("s3")
    if upload.sidecar is not None:
        s3.put_object(Bucket=bucket, Key=upload.key.rsplit(".", 1)[0] + ".json", Body=json.dumps(upload.sidecar).encode())
    s3.put_object(Bucket=bucket, Key=upload.key, Body=upload.body)


def queue_depth(urls: Iterable[str]) -> int:
    """Messages visible, in flight or delayed, over the queues."""
    return sum(aws.queue_depth(url, delayed=True) for url in urls)


def wait_until(done: Callable[[], bool], timeout_s: float, every_s: float = 1.0, check: Callable[[], None] = lambda: None
               ) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        if done():
            return True
        time.sleep(every_s)
    return False


def sealed(table: str) -> list[ShardSealed]:
    return [ShardSealed.model_validate_json(i["record"]) for i in aws.scan_prefix(table, pipeline_table.SEALED_PREFIX)]


def read_back(shard: ShardSealed) -> list[str]:
    """What is wrong with a sealed shard read as a consumer would: tarfile and webdataset must both
    see, in index order, three members per sample (image, json, txt) whose json names the sample."""
    import webdataset

    problems = []
    index = aws.read_json_if_exists(shard.bucket, shard.index_key)
    if index is None:
        return [f"{shard.shard_id}: no index"]
    keys = [s["key"] for s in index["samples"]]
    body = aws.read_object(shard.bucket, shard.key)
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
        records = {n.rsplit(".", 1)[0]: json.loads(tar.extractfile(n).read()) for n in names if n.endswith(".json")}
    if [n.rsplit(".", 1)[0] for n in names[::3]] != keys or len(names) != 3 * len(keys):
        problems.append(f"{shard.shard_id}: tar members do not follow the index")
    if any(records.get(k, {}).get("sha256") != k for k in keys):
        problems.append(f"{shard.shard_id}: a sample's json names another sample")
    with tempfile.NamedTemporaryFile(suffix=".tar") as file:
        file.write(body)
        file.flush()
        seen = [s["__key__"] for s in webdataset.WebDataset(file.name, shardshuffle=False)]
        if seen != keys:
            problems.append(f"{shard.shard_id}: webdataset reads {len(seen)} samples, the index lists {len(keys)}")
    return problems


def receive_all(url: str) -> list[dict[str, Any]]:
    """Every message of a queue, received and made visible again (nothing is removed)."""
    sqs, found = aws.client("sqs"), {}
    while batch := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=30).get("Messages"):
        found.update({m["MessageId"]: m for m in batch})
    for message in found.values():
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0)
    return list(found.values())
