"""atelier.local.s3_checksums: the local S3 refuses a body whose checksum is not the one its request names,
as S3 does, so no object is stored that a later GET fails to verify."""

from __future__ import annotations

import base64
import binascii
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.s3.responses import S3Response


@pytest.fixture
def patched() -> Iterator[None]:
    from atelier.local.s3_checksums import patch_s3_checksums
    saved = S3Response.__dict__["_get_checksum"]
    patch_s3_checksums()
    yield
    S3Response._get_checksum = saved  # type: ignore[method-assign]


@pytest.fixture
def s3(patched: None) -> Iterator[object]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="bucket")
        yield client


def crc32(data: bytes) -> str:
    return base64.b64encode(binascii.crc32(data).to_bytes(4, "big")).decode()


@pytest.mark.parametrize("send", [
    lambda s3, checksum: s3.put_object(Bucket="bucket", Key="k", Body=b"abc", ChecksumCRC32=checksum),
    lambda s3, checksum: s3.upload_part(Bucket="bucket", Key="k", PartNumber=1, Body=b"abc", ChecksumCRC32=checksum,
                                        UploadId=s3.create_multipart_upload(Bucket="bucket", Key="k",
                                                                            ChecksumAlgorithm="CRC32")["UploadId"]),
], ids=["PutObject", "UploadPart"])
def test_a_body_that_is_not_its_checksum_is_bad_digest_and_the_right_one_is_stored(s3, send) -> None:
    with pytest.raises(ClientError) as refused:
        send(s3, crc32(b"abd"))
    assert refused.value.response["Error"]["Code"] == "BadDigest"
    assert "Contents" not in s3.list_objects_v2(Bucket="bucket")  # nothing stored
    send(s3, crc32(b"abc"))


def test_a_put_with_the_right_checksum_reads_back_verified(s3) -> None:
    s3.put_object(Bucket="bucket", Key="k", Body=b"abc", ChecksumSHA256=base64.b64encode(
        __import__("hashlib").sha256(b"abc").digest()).decode())
    assert s3.get_object(Bucket="bucket", Key="k", ChecksumMode="ENABLED")["Body"].read() == b"abc"


@pytest.fixture
def server_s3(patched: None) -> Iterator[object]:
    """The patched S3 behind moto's server, as the local stack runs it (in-process moto does not tear the body)."""
    from moto.server import ThreadedMotoServer
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(port=port, verbose=False)
    server.start()
    try:
        client = boto3.client("s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{port}",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket="bucket")
        yield client
    finally:
        server.stop()


def test_a_file_rewritten_while_it_uploads_is_refused_or_stored_whole_never_stored_torn(server_s3, tmp_path: Path) -> None:
    # a checkpoint file the trainer is still writing while the local SageMaker's sync uploads it
    s3, path, refused, stored = server_s3, tmp_path / "state.pt", 0, 0
    for trial in range(8):
        path.write_bytes(os.urandom(1 << 20))
        stop = threading.Event()

        def rewrite() -> None:
            with open(path, "r+b") as stream:
                while not stop.is_set():
                    stream.seek(0)
                    stream.write(os.urandom(1 << 20))
                    stream.flush()
        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            s3.upload_file(str(path), "bucket", f"k{trial}")
        except S3UploadFailedError as error:
            assert "BadDigest" in str(error)
            refused += 1
            continue
        finally:
            stop.set()
            writer.join()
        s3.get_object(Bucket="bucket", Key=f"k{trial}", ChecksumMode="ENABLED")["Body"].read()  # verifies, or raises
        stored += 1
    assert refused + stored == 8
