"""S3 objects through the shared client: small reads and writes, tags, listings, versions, tar members."""

from __future__ import annotations

import json
import tarfile
from typing import Any, Iterator

from botocore.exceptions import ClientError

from core.aws import clients
from core.aws.clients import error_code


def head_object(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return clients.client("s3").head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in {"404", "NoSuchKey", "NotFound"}:
            return None
        raise


def read_object(bucket: str, key: str, max_bytes: int | None = None, version_id: str = "") -> bytes:
    """Read an object (that version of it, when given); with `max_bytes`, never more than that many
    bytes (a ranged GET)."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version_id:
        kwargs["VersionId"] = version_id
    if max_bytes is not None:
        kwargs["Range"] = f"bytes=0-{max_bytes - 1}"
    return clients.client("s3").get_object(**kwargs)["Body"].read()


def read_json_if_exists(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(clients.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise


def read_prefix_with_etag(bucket: str, key: str, max_bytes: int) -> tuple[bytes, str] | None:
    """At most the first `max_bytes` of an object and its ETag (one ranged GET); None when it does not exist."""
    try:
        response = clients.client("s3").get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max_bytes - 1}")
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise
    return response["Body"].read(), str(response.get("ETag", "")).strip('"')


def read_prefix_if_exists(bucket: str, key: str, max_bytes: int) -> bytes | None:
    """At most the first `max_bytes` of an object (one ranged GET); None when it does not exist."""
    try:
        return read_object(bucket, key, max_bytes=max_bytes)
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise


def write_object(bucket: str, key: str, body: bytes, content_type: str = "application/octet-stream") -> None:
    clients.client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)


def write_object_if_absent(bucket: str, key: str, body: bytes, content_type: str = "application/json") -> bool:
    """Create-only write (S3 answers 412 to an existing key); False when the key exists."""
    try:
        clients.client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type, IfNoneMatch="*")
        return True
    except ClientError as exc:
        if error_code(exc) in {"PreconditionFailed", "412", "ConditionalRequestConflict"}:
            return False
        raise


def tag_object(bucket: str, key: str, tags: dict[str, str]) -> None:
    """Replace an object's tags (quarantined uploads are tagged, so they are visible in S3)."""
    clients.client("s3").put_object_tagging(Bucket=bucket, Key=key, Tagging={
        "TagSet": [{"Key": k, "Value": v[:256]} for k, v in tags.items()]})


def list_objects(bucket: str, prefix: str = "") -> Iterator[dict[str, Any]]:
    """Every current object under `prefix`: Key, Size, ETag, LastModified, page by page."""
    for page in clients.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def has_objects(bucket: str, prefix: str) -> bool:
    """Whether any object lies under `prefix` (one listing call)."""
    return bool(clients.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount"))


def copy_object(bucket: str, source_key: str, key: str, metadata: dict[str, str]) -> None:
    """A server-side copy within `bucket` (one call: up to 5 GB), with `metadata` in place of the source's."""
    clients.client("s3").copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": source_key},
                                     Metadata=metadata, MetadataDirective="REPLACE")


def version_with_etag(bucket: str, key: str, etag: str) -> str:
    """The id of the version of `key` whose ETag is `etag` (a deleted object's versions remain), or ""."""
    if not etag:
        return ""
    pages = clients.client("s3").get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key)
    return next((v["VersionId"] for page in pages for v in page.get("Versions", [])
                 if v["Key"] == key and str(v.get("ETag", "")).strip('"') == etag), "")


def read_tar_member(uri: str, member: str, max_bytes: int = 16 * 2**20) -> bytes:
    """One small member of a (gzipped) tar in S3, read as a stream: a model artefact is not loaded whole."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body = clients.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    with tarfile.open(fileobj=body, mode="r|*") as archive:
        for info in archive:
            if info.isfile() and info.name.removeprefix("./") == member:
                if info.size > max_bytes:
                    raise ValueError(f"{uri}:{member} is {info.size} bytes, over {max_bytes}")
                extracted = archive.extractfile(info)
                return extracted.read() if extracted else b""
    raise FileNotFoundError(f"{uri} has no member {member}")
