"""Compile once per model shape across lineages: the compiled-shape files a lineage's training jobs
write (trainer/speed/compile_cache.py, into their checkpoints) are published to one shared prefix when a
job ends, and every training job reads that prefix as its `compile-cache` channel.

A lineage's own checkpoints carry its files from job to job. Without the shared prefix, a new
lineage, or the first job of a shape in any lineage, compiled cold: minutes before its first step
(bench/RESULTS.md: 169 s cold, 38 s warm for the SD-2 UNet at 512). Files are named by what decides
the compiled graphs (torch, GPU, UNet architecture, resolution, micro-batch, processes), so lineages
of the same shape share a file, and a trainer ignores the files of other shapes. A stale or corrupt
file only costs the compile it would have saved: the trainer falls back to compiling.

SageMaker fails a job whose S3Prefix channel holds no object, so the channel is attached only when
the prefix holds one. FastFile: a job reads only the file of its own shape, not the whole prefix.
A template lifecycle rule expires files no job has published for 30 days; each
publication copies the file again, so files in use stay.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger

from contracts import s3_layout
from core import aws

logger = Logger(child=True)

CHANNEL = "compile-cache"  # the trainer reads it as $SM_CHANNEL_COMPILE_CACHE (trainer/speed/compile_cache.py)
SOURCE_ETAG = "source-etag"  # a published copy's metadata: the ETag of the lineage's file it copies


def channels(models_bucket: str) -> list[dict[str, Any]]:
    """The `compile-cache` channel, or none while the shared prefix is empty."""
    if not aws.has_objects(models_bucket, s3_layout.COMPILE_CACHE):
        return []
    return [{"ChannelName": CHANNEL, "InputMode": "FastFile", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": s3_layout.uri(models_bucket, s3_layout.COMPILE_CACHE),
        "S3DataDistributionType": "FullyReplicated"}}}]


def publish(models_bucket: str, lineage: str) -> list[str]:
    """Copy the lineage's compiled-shape files to the shared prefix, each unless the shared copy
    already comes from that very file; the names copied. Repeating it copies nothing."""
    copied = []
    # Which shared copies exist comes from a listing: S3 answers a HeadObject of a missing key with
    # 403, not 404, to a role whose ListBucket is limited by prefix, as this function's is.
    present = {found["Key"] for found in aws.list_objects(models_bucket, s3_layout.COMPILE_CACHE)}
    for found in aws.list_objects(models_bucket, s3_layout.lineage_compile_cache_prefix(lineage)):
        name = found["Key"].rsplit("/", 1)[-1]
        if not name.endswith(s3_layout.COMPILE_CACHE_SUFFIX):
            continue  # a file the trainer is still writing has another name until its rename
        etag = str(found.get("ETag", "")).strip('"')
        target = s3_layout.COMPILE_CACHE + name
        shared = aws.head_object(models_bucket, target) if target in present else None
        if shared is not None and shared.get("Metadata", {}).get(SOURCE_ETAG) == etag:
            continue
        aws.copy_object(models_bucket, found["Key"], target, {SOURCE_ETAG: etag})
        copied.append(name)
    if copied:
        logger.info("compiled shapes published", extra={"lineage": lineage, "files": copied})
    return copied
