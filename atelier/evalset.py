"""The held-out evaluation set: licensed image/caption pairs every deploy candidate is scored on.

They go into one WebDataset tar under the data bucket's EvalDataPrefix (template parameter), in the
same member layout as training shards (`<key>.<ext>`, `<key>.txt`, `<key>.json`), and are never
uploaded for training: the gate compares models on data none of them learned from.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import boto3

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class EvalSetError(ValueError):
    """The folder cannot become an evaluation set; the message says why."""


@dataclass(frozen=True)
class EvalSample:
    image: bytes
    extension: str  # without the dot
    caption: str
    license: str
    partner: str
    source: str


def samples_from_folder(folder: Path, partner: str, licenses: tuple[str, ...]) -> list[EvalSample]:
    """Images with a `.json` sidecar (caption, license) or a `.txt` caption beside them; each
    sidecar's license must be one of `licenses` (those the partner holds in the registry)."""
    found = []
    for image in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        sidecar = image.with_suffix(".json")
        meta = _sidecar(sidecar)
        caption = str(meta.get("caption") or "").strip() or (image.with_suffix(".txt").read_text().strip()
                                                             if image.with_suffix(".txt").is_file() else "")
        license = meta.get("license")
        if not caption or not isinstance(license, str) or not license.strip():
            raise EvalSetError(f"{image}: an evaluation sample needs a caption and a license (in {sidecar.name})")
        if license.strip() not in licenses:
            raise EvalSetError(f"{image}: license {license!r} is not one partner {partner!r} holds ({list(licenses)})")
        found.append(EvalSample(image.read_bytes(), image.suffix.lower().lstrip(".").replace("jpeg", "jpg"),
                                caption, license.strip(), partner, str(meta.get("source", ""))))
    if not found:
        raise EvalSetError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return found


def _sidecar(path: Path) -> dict:
    """A sidecar's fields; none without one. A sidecar that is not a JSON object is an EvalSetError."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise EvalSetError(f"{path}: a sidecar is a JSON object with caption and license")
    return meta


def build_tar(samples: list[EvalSample]) -> bytes:
    """One tar, members of a sample together, fixed headers: the same samples give the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for index, sample in enumerate(samples):
            key = f"eval{index:06d}"
            meta = {"caption": sample.caption, "license": sample.license, "partner": sample.partner,
                    "source": sample.source, "sha256": hashlib.sha256(sample.image).hexdigest(), "split": "eval"}
            for suffix, data in ((sample.extension, sample.image), ("txt", sample.caption.encode()),
                                 ("json", json.dumps(meta, sort_keys=True).encode())):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def upload(samples: list[EvalSample], bucket: str, prefix: str, name: str) -> str:
    """Write the set as `<prefix><name>.tar`; returns its s3:// URI."""
    key = f"{prefix}{name}.tar"
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=build_tar(samples), ContentType="application/x-tar")
    return f"s3://{bucket}/{key}"
