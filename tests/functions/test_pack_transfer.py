"""core.aws's bulk S3 path over a real HTTP connection (moto as a server, not the in-process mock):
reads straight into the caller's buffer, parts sent from it, connections reused."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from core import aws
from core.pack import segments
from tests.support import moto_server

BUCKET = "transfer-bench"
MIB = 1 << 20


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_server() as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        aws.reset_clients()
        aws.client("s3").create_bucket(Bucket=BUCKET)
        aws.client("s3").put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
        yield url
    aws.reset_clients()


def test_an_object_is_read_straight_from_the_socket_into_the_buffer(server: str) -> None:
    # GIVEN an object of 3 MiB + 1 byte
    data = os.urandom(3 * MIB + 1)
    version = aws.put_bytes(BUCKET, "a", data, "application/octet-stream")
    # WHEN it is read into a preallocated buffer, in uneven pieces
    size, body = aws.open_object(BUCKET, "a", version)
    buffer = memoryview(bytearray(size + 10))
    got = 0
    with body:
        assert body.direct is not None  # an http.client response underneath: no urllib3 copy
        while count := body.readinto(buffer[got:got + 700_001]):
            got += count
    # THEN the buffer holds exactly the object, and the connection went back to the pool
    assert (size, got, bytes(buffer[:got])) == (len(data), len(data), data)
    assert aws.read_range(BUCKET, "a", 0, 4, version) == data[:4]
    pools = aws.transfer_client()._endpoint.http_session._manager.pools
    assert [pools[key].num_connections for key in pools.keys()] == [1]


def test_a_segment_streamed_over_http_is_the_bytes_written(server: str) -> None:
    # GIVEN a StreamUpload with 5 MiB parts (S3's smallest), fed from an object and from bytes
    source = os.urandom(11 * MIB + 3)
    aws.put_bytes(BUCKET, "source", source, "application/octet-stream")
    upload = segments.StreamUpload(BUCKET, "segment", "application/x-tar", 5 * MIB, checksum=False)
    upload.write(b"head")
    size, body = aws.open_object(BUCKET, "source")
    with body:
        assert upload.write_from(body, size) == size
    upload.write(b"tail" * 1000)
    # WHEN it is closed
    upload.close()
    # THEN the object is the bytes in order, in three parts (5 MiB, 5 MiB, the rest)
    assert aws.read_object(BUCKET, "segment") == b"head" + source + b"tail" * 1000
    assert len(upload.parts) == 3


def test_a_short_body_is_an_incomplete_read_not_a_short_sample(server: str) -> None:
    aws.put_bytes(BUCKET, "b", b"x" * 1000, "application/octet-stream")
    size, body = aws.open_object(BUCKET, "b")
    body.left = body.size = size + 1  # the server claims fewer bytes than expected
    with body, pytest.raises(aws.IncompleteReadError):
        buffer = memoryview(bytearray(2000))
        while body.readinto(buffer):
            pass


def test_a_warm_process_reuses_one_part_buffer_and_sends_only_what_each_upload_wrote(server: str) -> None:
    # GIVEN an upload that filled a part buffer with one pattern (and sent it as a multipart part)
    first = segments.StreamUpload(BUCKET, "first", "application/x-tar", 5 * MIB, checksum=False)
    buffer = first.buffer
    first.write(b"A" * (6 * MIB))
    first.close()
    # WHEN the next uploads (one at a time) write less than a part
    second = segments.StreamUpload(BUCKET, "second", "application/x-tar", 5 * MIB, checksum=False)
    reused = second.buffer is buffer
    second.write(b"b" * 10)
    second.close()
    aborted = segments.StreamUpload(BUCKET, "aborted", "application/x-tar", 5 * MIB, checksum=False)
    aborted.write(b"c")
    aborted.abort()
    # THEN they took the same buffer, and each object holds only its own bytes
    assert reused and aborted.buffer == bytearray()
    assert aws.read_object(BUCKET, "first") == b"A" * (6 * MIB)
    assert aws.read_object(BUCKET, "second") == b"b" * 10
    # AND two uploads open at once never share one
    one = segments.StreamUpload(BUCKET, "one", "application/x-tar", 5 * MIB, checksum=False)
    two = segments.StreamUpload(BUCKET, "two", "application/x-tar", 5 * MIB, checksum=False)
    assert one.buffer is buffer and two.buffer is not buffer
    one.write(b"1" * 100)
    two.write(b"2" * 100)
    one.close()
    two.close()
    assert (aws.read_object(BUCKET, "one"), aws.read_object(BUCKET, "two")) == (b"1" * 100, b"2" * 100)


def test_the_last_part_is_sent_from_the_part_buffer_not_a_copy(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy of the last part (up to a whole part) was the packer's only memory that grew with
    # shard size: glibc kept the freed copies, so peak RSS rose 30% from 100 MiB to 4 GiB shards.
    sent = []
    real_upload_part = aws.upload_part

    def recording_upload_part(*args, **kwargs):
        sent.append(args[4])
        return real_upload_part(*args, **kwargs)
    monkeypatch.setattr(aws, "upload_part", recording_upload_part)
    upload = segments.StreamUpload(BUCKET, "last-part", "application/x-tar", 5 * MIB, checksum=False)
    buffer = upload.buffer
    upload.write(b"x" * (5 * MIB + 7))
    upload.close()
    assert len(sent) == 2 and sent[0] is buffer
    assert isinstance(sent[1], memoryview) and sent[1].obj is buffer and len(sent[1]) == 7
    assert aws.read_object(BUCKET, "last-part") == b"x" * (5 * MIB + 7)
