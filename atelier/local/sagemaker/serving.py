"""The serving containers behind the endpoints: started, health-checked over /ping, drained, stopped.

An endpoint's live container, and the new one a deployment starts beside it, is a Server: a
container process on a loopback port, its tree under <state>/endpoints/<endpoint>/<config>/. The
Supervisor starts one (the model's ModelDataUrl unpacked into its /opt/ml/model, then `serve`, then
GET /ping until it answers), retires one (in-flight invocations drained, then SIGTERM and SIGKILL),
and at shutdown stops every one, with the background threads that start and retire them.
"""

from __future__ import annotations

import http.client
import shutil
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.containers import ContainerProcess, container_env, free_port, log_tail
from atelier.local.sagemaker.documents import utc_now
from atelier.local.sagemaker.hosting_resources import Model
from atelier.local.sagemaker.s3_transfers import S3Uri, download
from atelier.local.sagemaker.settings import Settings

RETIRE_GRACE_SECONDS = 10.0
PING_INTERVAL_SECONDS = 0.2


class DeployFailure(Exception):
    """A deployment that cannot go live; the message becomes the endpoint's FailureReason."""


class Server:
    """One serving container answering /ping and /invocations on a loopback port."""

    def __init__(self, process: ContainerProcess, *, port: int, root: Path, config: str, variant: str, image: str):
        self.process = process
        self.port = port
        self.root = root
        self.config = config
        self.variant = variant
        self.image = image
        self.started = utc_now()
        self._in_flight = 0
        self._idle = threading.Condition()
        self._stopped = False

    def healthy(self) -> bool:
        try:
            status, _, _ = self._request("GET", "/ping", None, {}, timeout=2.0)
        except OSError:
            return False
        return status == 200

    def wait_until_healthy(self, timeout: float, cancelled: threading.Event) -> None:
        """Poll /ping as SageMaker does; raise DeployFailure when the container exits or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise DeployFailure(
                    f"The primary container for production variant {self.variant} exited with code {code} "
                    f"before passing the ping health check. Log {self.process.log_path} ends:\n"
                    f"{log_tail(self.process.log_path, lines=12)}")
            if self.healthy():
                return
            if cancelled.wait(PING_INTERVAL_SECONDS):
                raise DeployFailure("The endpoint was deleted while it was being deployed.")
        raise DeployFailure(
            f"The primary container for production variant {self.variant} did not pass the ping health check "
            f"within {timeout:g} seconds. Log {self.process.log_path} ends:\n"
            f"{log_tail(self.process.log_path, lines=12)}")

    def invoke(self, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, dict[str, str], bytes]:
        return self._request("POST", "/invocations", body, headers, timeout)

    def enter(self) -> None:
        with self._idle:
            self._in_flight += 1

    def leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def stop(self, grace_seconds: float, drain_seconds: float) -> None:
        """Let in-flight invocations finish (up to drain_seconds), then stop the container. Idempotent."""
        with self._idle:
            if self._stopped:
                return
            self._stopped = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=drain_seconds)
        self.process.stop(grace_seconds)

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                 timeout: float) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()


class Supervisor:
    """Every serving container started and not yet stopped, and the threads that start and stop them."""

    def __init__(self, settings: Settings, clients: AwsClients):
        self._settings = settings
        self._clients = clients
        self._servers: set[Server] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def launch(self, endpoint: str, config: str, variant: dict[str, Any], model: Model,
               cancelled: threading.Event) -> Server:
        """Model data into <root>/opt_ml/model, then the container, then /ping until it answers;
        DeployFailure (the container retired) when it exits, never answers or `cancelled` is set."""
        root = self._deployment_root(endpoint, config)
        self._unpack_model(model, root)
        server = self._start_server(model, root, config, variant["VariantName"])
        timeout = variant.get("ContainerStartupHealthCheckTimeoutInSeconds", self._settings.startup_timeout_seconds)
        try:
            server.wait_until_healthy(timeout, cancelled)
        except DeployFailure:
            self.retire(server, RETIRE_GRACE_SECONDS, 0.0)
            raise
        return server

    def retire(self, server: Server, grace: float = RETIRE_GRACE_SECONDS, drain: float | None = None) -> None:
        """Drain the server's invocations (up to the invocation timeout unless `drain` says), then stop it."""
        server.stop(grace, self._settings.invoke_timeout_seconds if drain is None else drain)
        with self._lock:
            self._servers.discard(server)

    def in_background(self, target: Callable[..., Any], *args: Any, name: str) -> None:
        """Run target(*args) in a daemon thread that close() waits for."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def close(self, grace_seconds: float) -> None:
        """Stop every serving container, including ones still starting, and wait for them."""
        with self._lock:
            servers, threads = list(self._servers), list(self._threads)
        stoppers = [threading.Thread(target=self.retire, args=(server, grace_seconds, 0.0)) for server in servers]
        for thread in stoppers:
            thread.start()
        for thread in [*stoppers, *threads]:
            thread.join(timeout=grace_seconds + 30)

    def _deployment_root(self, endpoint: str, config: str) -> Path:
        """<state>/endpoints/<endpoint>/<config>; a suffix when that config is live and redeployed."""
        base = self._settings.state_dir / "endpoints" / endpoint / config
        with self._lock:
            in_use = {server.root for server in self._servers}
        root, copy = base, 1
        while root in in_use:
            copy += 1
            root = base.with_name(f"{config}.{copy}")
        return root

    def _unpack_model(self, model: Model, root: Path) -> None:
        model_dir = root / "opt_ml" / "model"
        shutil.rmtree(root / "opt_ml", ignore_errors=True)
        model_dir.mkdir(parents=True)
        url = model.container.get("ModelDataUrl")
        if not url:
            return
        archive = root / "model.tar.gz"
        try:
            download(self._clients.get("s3"), S3Uri.parse(url), archive)
            with tarfile.open(archive) as tar:
                tar.extractall(model_dir, filter="data")
        except Exception as error:  # any download or archive problem fails the deployment
            raise DeployFailure(f"Failed to extract model data archive from URL {url}: {error}") from error

    def _start_server(self, model: Model, root: Path, config: str, variant: str) -> Server:
        port = free_port()
        image = model.container["Image"]
        argv = self._settings.command(image, "serve")
        # the model's environment first: as on SageMaker, it cannot move the platform's port or paths
        env = container_env(model.container.get("Environment", {}), {
            "ATELIER_OPT_ML": str(root / "opt_ml"), "SAGEMAKER_BIND_TO_PORT": str(port),
            "SAGEMAKER_BIND_HOST": "127.0.0.1"}, isolated=bool(model.request.get("EnableNetworkIsolation")))
        try:
            process = ContainerProcess(argv, env, self._settings.cwd, root / "logs.txt")
        except OSError as error:
            raise DeployFailure(f"Cannot start the container {argv}: {error}") from error
        server = Server(process, port=port, root=root, config=config, variant=variant, image=image)
        with self._lock:
            self._servers.add(server)
        return server
