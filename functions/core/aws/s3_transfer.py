"""S3 for bulk bytes (the pack stage), through the transfer client: streamed and ranged reads,
whole-object writes, multipart uploads and server-side part copies, deletes of exact versions."""

from __future__ import annotations

import http.client
from typing import Any

from botocore.exceptions import ClientError, IncompleteReadError

from core.aws import clients
from core.aws.clients import error_code


class UploadGone(RuntimeError):
    """A multipart upload no longer exists (completed or aborted)."""


def _multipart_call(operation: str, **kwargs: Any) -> dict[str, Any]:
    try:
        return getattr(clients.transfer_client(), operation)(**kwargs)
    except ClientError as exc:
        if error_code(exc) == "NoSuchUpload":
            raise UploadGone(f"{kwargs.get('Key')}: upload {kwargs.get('UploadId')} is gone") from exc
        raise


def open_object(bucket: str, key: str, version_id: str = "") -> tuple[int, "Download"]:
    """(size, stream) of an object, of exactly `version_id` when given."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, **({"VersionId": version_id} if version_id else {})}
    response = clients.transfer_client().get_object(**kwargs)
    size = int(response["ContentLength"])
    return size, Download(response["Body"], size)


class Download:
    """An object's body whose `readinto` puts the bytes straight into the caller's buffer.

    botocore's `StreamingBody.readinto` goes through urllib3's, which reads into a new bytes
    object and copies it over. When an http.client response lies underneath (a real connection;
    moto's in-process mock has none), it is read directly: socket -> buffer, and the connection
    goes back to the pool once the body is read whole, as urllib3 does. Use `read` or `readinto`,
    not both.
    """

    def __init__(self, body: Any, size: int) -> None:
        self.body, self.size, self.left = body, size, size
        raw = getattr(body, "_raw_stream", None)
        direct = getattr(raw, "_fp", None)
        self.direct = direct if isinstance(direct, http.client.HTTPResponse) and hasattr(raw, "release_conn") \
            else None

    def readinto(self, buffer: memoryview) -> int:
        if self.direct is None:
            return int(self.body.readinto(buffer))
        count = self.direct.readinto(buffer[:self.left]) if self.left and len(buffer) else 0
        if not count and self.left and len(buffer):  # what StreamingBody raises on a short body
            raise IncompleteReadError(actual_bytes=self.size - self.left, expected_bytes=self.size)
        self.left -= count
        if not self.left:
            self.body._raw_stream.release_conn()
        return count

    def read(self, size: int = -1) -> bytes:
        return bytes(self.body.read(None if size < 0 else size))

    def close(self) -> None:
        self.body.close()

    def __enter__(self) -> "Download":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_range(bucket: str, key: str, start: int, end: int, version_id: str = "") -> bytes:
    """Bytes [start, end) of an object."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}",
                              **({"VersionId": version_id} if version_id else {})}
    return clients.transfer_client().get_object(**kwargs)["Body"].read()


def put_bytes(bucket: str, key: str, body: bytes, content_type: str, checksum: bool = True) -> str:
    """Write a whole object; returns its version id ("" in an unversioned bucket)."""
    response = clients.transfer_client().put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type,
                                                    **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    return str(response.get("VersionId", ""))


def create_multipart(bucket: str, key: str, content_type: str, metadata: dict[str, str] | None = None,
                     checksum: bool = True) -> str:
    response = clients.transfer_client().create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=metadata or {},
        **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    return str(response["UploadId"])


class _PartBody:
    """A part's bytes as the stream botocore sends: reads of a size are views of the caller's buffer,
    so urllib3 hands them to the socket without a copy (a `bytes` body is copied into a BytesIO and
    read back a block at a time). Seekable, so a retried request starts again from the top."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(data)
        self.position = 0

    def read(self, size: int | None = -1) -> bytes | memoryview:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.position + size)
        chunk = self.view[self.position:end]
        self.position = end
        return chunk if size is not None and size >= 0 else bytes(chunk)  # read(): a whole copy (moto's mock)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = max(0, min(len(self.view), offset + (0, self.position, len(self.view))[whence]))
        return self.position

    def tell(self) -> int:
        return self.position


def upload_part(bucket: str, key: str, upload_id: str, number: int, body: bytes | bytearray | memoryview,
                checksum: bool = True) -> dict[str, Any]:
    """Upload one part; returns its entry for `complete_multipart`. `body` is sent from where it
    lies (no copy) and must not change until this returns."""
    response = _multipart_call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                               Body=_PartBody(body), **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    part = {"PartNumber": number, "ETag": response["ETag"]}
    if checksum:
        part["ChecksumCRC32"] = response["ChecksumCRC32"]
    return part


def upload_part_copy(bucket: str, key: str, upload_id: str, number: int, source_key: str, source_version: str,
                     start: int, end: int) -> dict[str, Any]:
    """Copy bytes [start, end) of another object of the bucket into a part, server-side."""
    source: dict[str, str] = {"Bucket": bucket, "Key": source_key, **({"VersionId": source_version}
                                                                       if source_version else {})}
    response = _multipart_call("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                               CopySource=source, CopySourceRange=f"bytes={start}-{end - 1}")
    return {"PartNumber": number, "ETag": response["CopyPartResult"]["ETag"]}


def complete_multipart(bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]]) -> str:
    """Complete an upload; returns the object's version id."""
    response = _multipart_call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                               MultipartUpload={"Parts": parts})
    return str(response.get("VersionId", ""))


def abort_multipart(bucket: str, key: str, upload_id: str) -> None:
    try:
        _multipart_call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except UploadGone:
        pass


def delete_object(bucket: str, key: str, version_id: str = "") -> None:
    """Delete an object, or exactly one version of it (which removes it for good)."""
    clients.transfer_client().delete_object(Bucket=bucket, Key=key,
                                            **({"VersionId": version_id} if version_id else {}))
