"""The members of a shard's samples: what the packer and the importer write, what trainer/jobs/encode.py
writes into a latent shard, and what the trainer reads (docs/pack.md).

A sample is the consecutive members of a tar sharing a key (webdataset's rule: the name up to the
first dot of its basename), each named `<key>.<extension>`. An image shard's sample is an image,
its metadata record and its caption; a latent shard's is the latents, the caption's token ids (a UNet's)
or its text embeddings (a transformer family's) and the same record. A family's latent shard also
opens with one member that is no sample: the empty caption's embeddings (`EMPTY_CAPTION_KEY`), which
caption dropout trains on; indexes leave it out. Every tar is POSIX ustar with fixed headers (mtime 0, uid/gid 0, mode 0644, no
user names), so the same members in the same order are the same bytes.
"""

from __future__ import annotations

import tarfile

RECORD = "json"  # the metadata record: width, height, format, partner, license, aspect_bucket, ...
CAPTION = "txt"
# the stored image's extension -> its Pillow format (the packer stores these; the trainer reads them)
IMAGE_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
LATENTS = "latents.safetensors"  # the VAE's posterior for the sample's bucket, with its header metadata
IDS = "ids.npy"  # the caption's token ids, one row per text encoder
TEXT = "text.safetensors"  # a transformer family's caption embeddings (its pipeline's encode_prompt), bf16
EMPTY_CAPTION_KEY = "_empty-caption"  # the key of a family latent shard's first member: the empty caption's TEXT
# what the importer takes from a source tar (img2dataset's and other webdatasets'), in order of
# preference; the image's format is sniffed by the decoder, never taken from the name
SOURCE_IMAGES = ("jpg", "jpeg", "png", "webp", "tif", "tiff", "bmp", "gif")
SOURCE_CAPTIONS = ("txt", "caption")
TAR_FORMAT = tarfile.USTAR_FORMAT


def member_name(key: str, extension: str) -> str:
    return f"{key}.{extension}"


def tarinfo(name: str, size: int) -> tarfile.TarInfo:
    """A member's header with the fixed metadata that makes a tar's bytes reproducible."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def member_header(name: str, size: int) -> bytes:
    """One ustar header block; a name ustar cannot hold raises ValueError."""
    return tarinfo(name, size).tobuf(format=TAR_FORMAT, encoding="utf-8", errors="strict")
