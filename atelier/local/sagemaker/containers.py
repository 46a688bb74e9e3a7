"""Container processes: what stands in for `docker run`, for training and serving alike."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


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


def container_env(*layers: Mapping[str, str], isolated: bool = False) -> dict[str, str]:
    """os.environ, then each layer on top; Python output unbuffered so logs can be tailed live.

    This interpreter's scripts directory leads PATH, as an image's own environment would: the
    container finds `torchrun` of the Python it runs with even when no virtualenv is activated.
    `isolated` (EnableNetworkIsolation): SageMaker gives such a container no AWS credentials and no
    network. The network cannot be cut here, so none of this process's AWS settings (the local
    stack's keys and endpoint) are passed on, and boto3 finds no credentials elsewhere either.
    """
    scripts = str(Path(sys.executable).parent)
    inherited = {k: v for k, v in os.environ.items() if not (isolated and k.startswith("AWS_"))}
    env = {**inherited, "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")]))}
    if isolated:
        env.update({"AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
                    "AWS_EC2_METADATA_DISABLED": "true"})
    for layer in layers:
        env.update(layer)
    return env


def free_port() -> int:
    """A loopback port nobody listens on now (the container binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
