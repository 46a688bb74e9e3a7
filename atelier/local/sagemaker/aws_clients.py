"""The boto3 clients the local SageMaker itself uses (S3, EventBridge, CloudWatch on moto)."""

from __future__ import annotations

import threading
from typing import Any

import boto3


class AwsClients:
    """The boto3 clients the emulator itself uses (S3, EventBridge on moto), made on first use.

    Made lazily because the local stack sets AWS_ENDPOINT_URL after importing this module; one
    session because boto3's default session is not safe to share between threads.
    """

    def __init__(self, region: str, session: boto3.session.Session | None = None):
        self._session = session or boto3.session.Session(region_name=region)
        self._region = region
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, service: str) -> Any:
        with self._lock:
            if service not in self._clients:
                self._clients[service] = self._session.client(service, region_name=self._region)
            return self._clients[service]
