"""S3 URIs and the transfers of channels, checkpoints, model data and outputs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atelier.local.sagemaker.validation import not_emulated


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str, member: str = "S3Uri") -> S3Uri:
        match = re.fullmatch(r"s3://([^/]+)/?(.*)", uri or "")
        if not match:
            raise not_emulated(f"{member} '{uri}' (s3:// URIs only)")
        return cls(match[1], match[2])

    def join(self, *parts: str) -> S3Uri:
        key = "/".join([self.key.rstrip("/"), *(p.strip("/") for p in parts)]).lstrip("/")
        return S3Uri(self.bucket, key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def list_keys(s3: Any, prefix: S3Uri) -> Iterator[str]:
    """Every object key under the prefix, skipping folder markers."""
    for listing in s3.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=prefix.key):
        for item in listing.get("Contents", []):
            if not item["Key"].endswith("/"):
                yield item["Key"]


def inside(root: Path, relative: str) -> Path:
    """root/relative, refusing keys that would escape root ("../", absolute)."""
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ValueError(f"key {relative!r} escapes {root}")
    return target


def relative_key(key: str, prefix: str) -> str:
    """The path an object gets under a channel or checkpoint dir: the key after the prefix."""
    relative = key[len(prefix):].lstrip("/")
    return relative or key.rsplit("/", 1)[-1]


def download(s3: Any, source: S3Uri, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    s3.download_file(source.bucket, source.key, str(target))


def download_prefix(s3: Any, prefix: S3Uri, root: Path) -> list[Path]:
    """Every object under the prefix into root, keeping paths relative to the prefix."""
    paths = []
    for key in list_keys(s3, prefix):
        target = inside(root, relative_key(key, prefix.key))
        download(s3, S3Uri(prefix.bucket, key), target)
        paths.append(target)
    return paths


def upload(s3: Any, source: Path, target: S3Uri) -> None:
    s3.upload_file(str(source), target.bucket, target.key)
