"""What the local training runner and the local endpoints share.

API errors in SageMaker's shape, ARNs, request checks, S3 transfers, container processes and the
JSON state files. Nothing here knows about jobs or endpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3

from core.training.instance_types import has_instance_store

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# `docker run <image> train|serve` runs the image's ENTRYPOINT with that argument; locally the
# entrypoint is a command line, by default the project's container module.
DEFAULT_ENTRYPOINT = (sys.executable, "-m", "trainer.container")
# SageMaker's resource-name rule (jobs, endpoints, endpoint configs); models allow inner runs of '-'.
NAME_PATTERN = r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$"
MODEL_NAME_PATTERN = r"^[a-zA-Z0-9]([\-a-zA-Z0-9]*[a-zA-Z0-9])?$"
MAX_NAME_LENGTH = 63

Entrypoints = Mapping[str, Sequence[str]] | Callable[[str], Sequence[str]] | None


class ApiError(Exception):
    """A SageMaker error response: botocore raises it as ClientError with this code."""

    def __init__(self, code: str, message: str, status: int = 400, fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.fields = fields or {}


def validation_error(message: str) -> ApiError:
    return ApiError("ValidationException", message)


@dataclass(frozen=True)
class Settings:
    """How the local SageMaker runs: where state lives, which command an image runs, timings."""

    state_dir: Path
    region: str = "us-east-1"
    account_id: str = "123456789012"  # moto's default account
    entrypoints: Entrypoints = None
    cwd: Path = REPO_ROOT
    checkpoint_sync_seconds: float = 5.0
    stop_grace_seconds: float = 120.0  # SageMaker's SIGTERM-to-SIGKILL window
    startup_timeout_seconds: float = 300.0
    invoke_timeout_seconds: float = 60.0  # SageMaker's invocation timeout
    alarm_poll_seconds: float = 1.0  # how often a deployment reads its rollback alarms while baking
    metrics_flush_seconds: float = 1.0  # endpoint metrics go to CloudWatch this often (SageMaker: 60)

    def arn(self, kind: str, name: str) -> str:
        # SageMaker lower-cases the name inside its ARNs.
        return f"arn:aws:sagemaker:{self.region}:{self.account_id}:{kind}/{name.lower()}"

    def command(self, image: str, mode: str) -> list[str]:
        """The argv that stands in for `docker run <image> <mode>`."""
        if callable(self.entrypoints):
            entrypoint = self.entrypoints(image)
        elif self.entrypoints is not None and image in self.entrypoints:
            entrypoint = self.entrypoints[image]
        else:
            entrypoint = DEFAULT_ENTRYPOINT
        return [*entrypoint, mode]


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


# --- requests ------------------------------------------------------------------------------------

def check_name(value: Any, member: str, pattern: str = NAME_PATTERN) -> str:
    """The name, or the ValidationException SageMaker gives for one that breaks its rule."""
    if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or not re.fullmatch(pattern, value):
        raise validation_error(
            f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy constraint: "
            f"Member must satisfy regular expression pattern: {pattern}")
    return value


def require(request: Mapping[str, Any], path: str) -> Any:
    """request[a][b] for path "a.b", or the ValidationException for a missing member."""
    value: Any = request
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            member = ".".join(p[0].lower() + p[1:] for p in path.split("."))
            raise validation_error(
                f"1 validation error detected: Value null at '{member}' failed to satisfy constraint: "
                "Member must not be null")
    return value


def page(items: list[dict[str, Any]], request: Mapping[str, Any], default_size: int = 10) -> tuple[list, str | None]:
    """One page of a List* answer; the NextToken is the offset of the next item."""
    try:
        start = int(request.get("NextToken") or 0)
    except ValueError:
        raise validation_error("Invalid pagination token") from None
    size = int(request.get("MaxResults") or default_size)
    end = start + size
    return items[start:end], (str(end) if end < len(items) else None)


# --- time and state files ------------------------------------------------------------------------

def utc_now() -> datetime:
    return datetime.now(UTC)


def convert_times(value: Any, stamp: Callable[[datetime], Any]) -> Any:
    """A copy of a describe-like document with every datetime passed through stamp."""
    if isinstance(value, datetime):
        return stamp(value)
    if isinstance(value, Mapping):
        return {key: convert_times(item, stamp) for key, item in value.items()}
    if isinstance(value, list):
        return [convert_times(item, stamp) for item in value]
    return value


def epoch_seconds(moment: datetime) -> float:
    """The JSON protocol's timestamp (botocore parses epoch seconds)."""
    return moment.timestamp()


def epoch_millis(moment: datetime) -> int:
    """SageMaker's EventBridge events carry epoch milliseconds."""
    return int(moment.timestamp() * 1000)


def write_state(path: Path, document: Mapping[str, Any]) -> None:
    """Write a describe document for humans and `atelier` status commands; atomic so a reader
    never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_text(json.dumps(convert_times(document, datetime.isoformat), indent=2, sort_keys=True))
    os.replace(temporary, path)


# --- S3 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str, member: str = "S3Uri") -> S3Uri:
        match = re.fullmatch(r"s3://([^/]+)/?(.*)", uri or "")
        if not match:
            raise validation_error(f"Invalid {member} '{uri}': expected s3://bucket/key")
        return cls(match[1], match[2])

    def join(self, *parts: str) -> S3Uri:
        key = "/".join([self.key.rstrip("/"), *(p.strip("/") for p in parts)]).lstrip("/")
        return S3Uri(self.bucket, key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def list_keys(s3: Any, prefix: S3Uri) -> Iterator[str]:
    """Every object key under the prefix, skipping folder markers."""
    for listing in s3.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=prefix.key):
        for item in listing.get("Contents", []):
            if not item["Key"].endswith("/"):
                yield item["Key"]


def inside(root: Path, relative: str) -> Path:
    """root/relative, refusing keys that would escape root ("../", absolute)."""
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ValueError(f"key {relative!r} escapes {root}")
    return target


def relative_key(key: str, prefix: str) -> str:
    """The path an object gets under a channel or checkpoint dir: the key after the prefix."""
    relative = key[len(prefix):].lstrip("/")
    return relative or key.rsplit("/", 1)[-1]


def download(s3: Any, source: S3Uri, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    s3.download_file(source.bucket, source.key, str(target))


def download_prefix(s3: Any, prefix: S3Uri, root: Path) -> list[Path]:
    """Every object under the prefix into root, keeping paths relative to the prefix."""
    paths = []
    for key in list_keys(s3, prefix):
        target = inside(root, relative_key(key, prefix.key))
        download(s3, S3Uri(prefix.bucket, key), target)
        paths.append(target)
    return paths


def upload(s3: Any, source: Path, target: S3Uri) -> None:
    s3.upload_file(str(source), target.bucket, target.key)


# --- container processes -------------------------------------------------------------------------

@dataclass
class ContainerProcess:
    """A local stand-in for a container: a child process in its own process group, so stopping it
    also stops what it spawned (torchrun workers), with stdout and stderr in one log file."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    _popen: subprocess.Popen = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def stop(self, grace_seconds: float) -> int:
        """SIGTERM, then SIGKILL after the grace period, as SageMaker stops a container."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._popen.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
        code = self._popen.wait()
        self.reap_group()
        return code

    def terminate(self) -> None:
        """SIGTERM the group without waiting: stop() then waits out what is left of the grace."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL the whole group at once: what an instance that goes away does to its container."""
        self._signal_group(signal.SIGKILL)
        return self._popen.wait()

    def reap_group(self) -> None:
        """Kill anything the container left behind in its group once it has exited."""
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self._popen.pid, signum)


def log_tail(path: Path, lines: int = 20, max_bytes: int = 8192) -> str:
    """The last lines of a log, for failure reasons and debugging."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - max_bytes))
            text = log.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def container_env(*layers: Mapping[str, str]) -> dict[str, str]:
    """os.environ, then each layer on top; Python output unbuffered so logs can be tailed live.

    This interpreter's scripts directory leads PATH, as an image's own environment would: the
    container finds `torchrun` of the Python it runs with even when no virtualenv is activated.
    """
    scripts = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")]))}
    for layer in layers:
        env.update(layer)
    return env


def free_port() -> int:
    """A loopback port nobody listens on now (the container binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_volume_key(instance_type: str, key: str | None, member: str) -> None:
    """SageMaker refuses a KMS key for the volumes of an instance type with instance store (its
    hardware encrypts them; core/training/instance_types.py has the rule and its source)."""
    if key and has_instance_store(instance_type):
        raise validation_error(f"{member} is not supported for instance type {instance_type}: its local instance "
                               "storage is encrypted by the instance's hardware module; do not specify a KMS key for it")
