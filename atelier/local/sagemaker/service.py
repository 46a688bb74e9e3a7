"""The local SageMaker service: training jobs and endpoints behind one loopback HTTP server.

    sagemaker = start_local_sagemaker(state_dir=Path(".atelier/sagemaker"))
    os.environ.update(sagemaker.client_environment())
    ...
    sagemaker.close()
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

import boto3
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.endpoints import Hosting
from atelier.local.sagemaker.protocol import SageMakerApp
from atelier.local.sagemaker.settings import Settings
from atelier.local.sagemaker.tags import ResourceTags
from atelier.local.sagemaker.training_jobs import TrainingJobs

logger = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 10.0


class _QuietHandler(WSGIRequestHandler):
    """Request lines go to debug logging, not stderr: the pipeline polls Describe a lot."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        logger.debug("%s %s %s", self.command, self.path, code)


class LocalSageMaker:
    """The local SageMaker service: training jobs, endpoints and the HTTP server in front of them."""

    def __init__(self, settings: Settings, session: boto3.session.Session | None = None):
        self.settings = settings
        clients = AwsClients(settings.region, session)
        self.tags = ResourceTags()
        self.jobs = TrainingJobs(settings, clients, self.tags)
        self.hosting = Hosting(settings, clients, self.tags)
        self.app = SageMakerApp(self.jobs, self.hosting, self.tags)
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0 = any free port) in a background thread; the base URL."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self._server = make_server(host, port, self.app, threaded=True, request_handler=_QuietHandler)
        # A short poll interval: shutdown() waits for the serving loop to notice it.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="local-sagemaker", daemon=True)
        self._thread.start()
        # Container processes run in their own sessions: make sure they die with this process.
        atexit.register(self.close)
        return self.url

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("LocalSageMaker.start() has not been called")
        return f"http://{self._server.host}:{self._server.port}"

    def training_log_tail(self, job_name: str, lines: int = 40) -> str:
        """The end of a training job's container log, for debugging a failed job."""
        return self.jobs.log_tail(job_name, lines)

    def lose_training_instance(self, job_name: str, host: str = "algo-1",
                               once: Callable[[], bool] | None = None) -> None:
        """Fault injection: kill one instance of a running job as a hardware failure would (the
        attempt fails as an InternalServerError; RetryStrategy decides whether it starts over).
        With `once`, at the first moment once() holds, tested after each checkpoint upload: from then
        on nothing more of that attempt reaches the checkpoint S3Uri, even if its containers end first."""
        self.jobs.lose_instance(job_name, host, once)

    def client_environment(self) -> dict[str, str]:
        """The variables that send boto3's sagemaker and sagemaker-runtime clients here."""
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.url, "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": self.url}

    def close(self, grace_seconds: float = CLOSE_GRACE_SECONDS) -> None:
        """Stop taking requests, stop every job (they end Stopped) and every serving container."""
        atexit.unregister(self.close)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        try:
            self.jobs.close(grace_seconds)
        finally:  # whatever happened to the jobs, no serving container may outlive the stack
            self.hosting.close(grace_seconds)


def start_local_sagemaker(settings: Settings | None = None, session: boto3.session.Session | None = None,
                          host: str = "127.0.0.1", port: int = 0, **options: Any) -> LocalSageMaker:
    """Start the local SageMaker on a loopback port; its .url and .client_environment() say where.

    Either pass Settings, or its fields as keywords (state_dir=..., entrypoints=..., ...).
    """
    service = LocalSageMaker(settings or Settings(**options), session)
    service.start(host, port)
    return service

