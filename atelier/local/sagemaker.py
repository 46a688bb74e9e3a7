"""The local SageMaker: the subset of the SageMaker and SageMaker Runtime APIs the pipeline uses.

moto's SageMaker completes jobs at once and sends no events, so the local stack serves these APIs
itself, on one loopback HTTP server speaking the real wire protocols. Pipeline code stays plain
boto3: it reaches this server through AWS_ENDPOINT_URL_SAGEMAKER and
AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME, while S3 and EventBridge stay on moto (AWS_ENDPOINT_URL).

    sagemaker = start_local_sagemaker(Path(".atelier/sagemaker"))
    os.environ.update(sagemaker.client_environment())
    ...
    sagemaker.close()

See docs/local-sagemaker.md for what is emulated and what is not.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

import boto3
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

from atelier.local.sagemaker_common import ApiError, AwsClients, Settings, convert_times, epoch_seconds
from atelier.local.sagemaker_endpoints import Hosting
from atelier.local.sagemaker_jobs import TrainingJobs
from atelier.local.sagemaker_tags import ResourceTags

logger = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/x-amz-json-1.1"
TARGET_PREFIX = "SageMaker."
INVOCATIONS_PATH = re.compile(r"/endpoints/([^/]+)/invocations")
CLOSE_GRACE_SECONDS = 10.0


class SageMakerApp:
    """WSGI app: SageMaker's JSON 1.1 protocol (POST / with X-Amz-Target) and the Runtime's
    REST POST /endpoints/<name>/invocations, over the local jobs and endpoints."""

    def __init__(self, jobs: TrainingJobs, hosting: Hosting, tags: ResourceTags):
        self._operations: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "CreateTrainingJob": jobs.create, "DescribeTrainingJob": jobs.describe,
            "ListTrainingJobs": jobs.list_jobs, "StopTrainingJob": jobs.stop,
            "CreateModel": hosting.create_model, "DescribeModel": hosting.describe_model,
            "DeleteModel": hosting.delete_model, "ListModels": hosting.list_models,
            "CreateEndpointConfig": hosting.create_endpoint_config,
            "DescribeEndpointConfig": hosting.describe_endpoint_config,
            "DeleteEndpointConfig": hosting.delete_endpoint_config,
            "CreateEndpoint": hosting.create_endpoint, "DescribeEndpoint": hosting.describe_endpoint,
            "UpdateEndpoint": hosting.update_endpoint, "DeleteEndpoint": hosting.delete_endpoint,
            "ListEndpoints": hosting.list_endpoints,
            "AddTags": tags.add_tags, "ListTags": tags.list_tags, "DeleteTags": tags.delete_tags,
        }
        self._hosting = hosting

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        return self.respond(Request(environ))(environ, start_response)

    def respond(self, request: Request) -> Response:
        invocation = INVOCATIONS_PATH.fullmatch(request.path)
        if invocation and request.method == "POST":
            return self._invoke(unquote(invocation[1]), request)
        target = request.headers.get("X-Amz-Target", "")
        if request.method == "POST" and target.startswith(TARGET_PREFIX):
            return self._call(target.removeprefix(TARGET_PREFIX), request)
        return json_error(ApiError("UnknownOperationException", f"No SageMaker operation at {request.method} "
                                   f"{request.path}", 404))

    def _call(self, operation: str, request: Request) -> Response:
        handler = self._operations.get(operation)
        if handler is None:
            return json_error(ApiError("UnknownOperationException",
                                       f"The local SageMaker does not implement {operation}"))
        try:
            body = json.loads(request.get_data() or b"{}")
        except ValueError:
            return json_error(ApiError("SerializationException", "The request body is not JSON"))
        try:
            result = handler(body)
        except ApiError as error:
            return json_error(error)
        except Exception:  # answer as AWS does, keep serving
            logger.exception("SageMaker.%s failed", operation)
            return json_error(ApiError("InternalFailure", f"The local SageMaker failed on {operation}", 500))
        return Response(json.dumps(convert_times(result, epoch_seconds)), 200,
                        {"Content-Type": JSON_CONTENT_TYPE, "x-amzn-RequestId": str(uuid.uuid4())})

    def _invoke(self, endpoint: str, request: Request) -> Response:
        forwarded = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream")}
        for header in ("Accept", "X-Amzn-SageMaker-Custom-Attributes"):
            if request.headers.get(header):
                forwarded[header] = request.headers[header]
        try:
            result = self._hosting.invoke(endpoint, request.get_data(), forwarded)
        except ApiError as error:
            return rest_error(error)
        headers = {"Content-Type": result.content_type, "x-Amzn-Invoked-Production-Variant": result.variant,
                   "x-amzn-RequestId": str(uuid.uuid4())}
        if result.custom_attributes:
            headers["X-Amzn-SageMaker-Custom-Attributes"] = result.custom_attributes
        return Response(result.body, 200, headers)


def json_error(error: ApiError) -> Response:
    """The JSON 1.1 error shape botocore turns into ClientError(code, message)."""
    body = {"__type": error.code, "message": error.message, **error.fields}
    return Response(json.dumps(body), error.status,
                    {"Content-Type": JSON_CONTENT_TYPE, "x-amzn-RequestId": str(uuid.uuid4())})


def rest_error(error: ApiError) -> Response:
    """The REST-JSON error shape of the Runtime: the code travels in x-amzn-ErrorType."""
    body = {"ErrorCode": error.code, "Message": error.message, **error.fields}
    return Response(json.dumps(body), error.status,
                    {"Content-Type": "application/json", "x-amzn-ErrorType": error.code,
                     "x-amzn-RequestId": str(uuid.uuid4())})


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

    def lose_training_instance(self, job_name: str, host: str = "algo-1") -> None:
        """Fault injection: kill one instance of a running job as a hardware failure would (the
        attempt fails as an InternalServerError; RetryStrategy decides whether it starts over)."""
        self.jobs.lose_instance(job_name, host)

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

    def __enter__(self) -> LocalSageMaker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_local_sagemaker(settings: Settings | None = None, session: boto3.session.Session | None = None,
                          host: str = "127.0.0.1", port: int = 0, **options: Any) -> LocalSageMaker:
    """Start the local SageMaker on a loopback port; its .url and .client_environment() say where.

    Either pass Settings, or its fields as keywords (state_dir=..., entrypoints=..., ...).
    """
    service = LocalSageMaker(settings or Settings(**options), session)
    service.start(host, port)
    return service


__all__ = ["LocalSageMaker", "SageMakerApp", "Settings", "start_local_sagemaker"]
