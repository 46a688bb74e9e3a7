"""S3's check of a request's checksum, which moto's server leaves out.

S3 computes the checksum of what it received and refuses a PutObject or UploadPart whose
`x-amz-checksum-<algorithm>` (a header, or the trailer of an aws-chunked body) names another value:
400 BadDigest, and nothing is stored. moto stores the body with the client's value unchecked
(`S3Response._get_checksum`: "TODO: AWS computes the provided value and verifies it's the same"), so an
upload whose body changed between the SDK's checksum and its send (a checkpoint file the trainer was still
writing while the local SageMaker's sync read it) became an object every later GET fails to verify
(botocore's FlexibleChecksumError), where S3 would have refused the PUT and the sync tried again.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from moto.s3.exceptions import S3ClientError
from moto.s3.responses import S3Response
from moto.s3.utils import compute_checksum

ALGORITHMS = ("CRC32C", "CRC32", "SHA1", "SHA256", "CRC64NVME")
HEADER = re.compile(rf"x-amz-checksum-({'|'.join(ALGORITHMS)})$", re.IGNORECASE)
TRAILER = re.compile(rb"x-amz-checksum-(\w+):([A-Za-z0-9+/=]+)")


class BadDigest(S3ClientError):
    def __init__(self, algorithm: str):
        super().__init__("BadDigest", f"The {algorithm} you specified did not match the calculated checksum.")


def exact_algorithms() -> set[str]:
    """The algorithms moto's compute_checksum computes as S3 does (without its optional libraries it
    answers CRC32 for CRC32C and CRC64NVME: those are not checked then)."""
    found = {"CRC32", "SHA1", "SHA256"}
    if importlib.util.find_spec("crc32c"):
        found.add("CRC32C")
    if importlib.util.find_spec("awscrt"):
        found.add("CRC64NVME")
    return found


def named_checksums(headers: Any, raw_body: Any) -> dict[str, str]:
    """The checksums a request names: `x-amz-checksum-<algorithm>` headers, and the trailer that ends an
    aws-chunked body (what botocore sends by default)."""
    named = {match.group(1).upper(): value for name, value in headers.items() if (match := HEADER.match(name))}
    if isinstance(raw_body, bytes) and (trailer := TRAILER.search(raw_body[-512:])):
        named.setdefault(trailer.group(1).decode().upper(), trailer.group(2).decode())
    return named


def _checked(get_checksum: Any) -> Any:
    exact = exact_algorithms()

    def call(self: S3Response, response_headers: dict[str, Any]) -> tuple[str, str | None]:
        if isinstance(self.body, bytes):
            for algorithm, value in named_checksums(self.headers, self.raw_body).items():
                if algorithm in exact and compute_checksum(self.body, algorithm).decode() != value:
                    raise BadDigest(algorithm)
        return get_checksum(self, response_headers)
    call.patched = True  # type: ignore[attr-defined]
    return call


def patch_s3_checksums() -> None:
    """PutObject and UploadPart refuse a body whose checksum is not the one the request names, as S3 does."""
    if not getattr(S3Response._get_checksum, "patched", False):
        S3Response._get_checksum = _checked(S3Response._get_checksum)  # type: ignore[method-assign]
