"""boto3 clients for every service the pipeline calls, made on first use and never at import.

Every client honours AWS_ENDPOINT_URL (and the per-service AWS_ENDPOINT_URL_<SERVICE>), so the
same code reaches real AWS or the local stack. The other modules of core.aws call `clients.client`
through this module at call time, so a test that replaces it reaches every call.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

# A connection for each of the (at most 16) calls a function sends at once (core.ingest.dedup).
_RETRIES = Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=16)


def client(service: str) -> Any:
    """A cached client, one per service and per endpoint/credential environment: a process whose
    environment changes (the local stack, the CLI's --local, tests) never reuses a stale one."""
    return _client(service, tuple(os.environ.get(name, "") for name in (
        "AWS_ENDPOINT_URL", f"AWS_ENDPOINT_URL_{service.upper().replace('-', '_')}", "AWS_DEFAULT_REGION",
        "AWS_REGION", "AWS_ACCESS_KEY_ID")))


@functools.cache
def _client(service: str, environment: tuple[str, ...]) -> Any:
    return boto3.client(service, config=_RETRIES)


def reset_clients() -> None:
    """Forget cached clients (moto's in-process mock must patch the ones tests use)."""
    _client.cache_clear()
    transfer_client.cache_clear()


@functools.cache
def transfer_client() -> Any:
    """S3 for bulk bytes (the packer): no SHA-256 payload signing, checksums only where asked.

    On AWS (HTTPS) boto3 already skips payload signing for streaming S3 bodies; plain-HTTP
    endpoints (the local stack) would otherwise hash every byte once more just to sign it.
    Checksums are computed or validated only when an operation requires one or a caller asks for
    CRC32 (`checksum=True`): segment and shard bytes are covered end to end by the shard digest
    instead (docs/pack.md, "Integrity"). `max_pool_connections` keeps a connection per thread.
    """
    config = _RETRIES.merge(Config(s3={"payload_signing_enabled": False},
                                   request_checksum_calculation="when_required",
                                   response_checksum_validation="when_required",
                                   max_pool_connections=16))
    return boto3.client("s3", config=config)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
