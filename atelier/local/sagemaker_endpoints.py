"""Models, endpoint configs and endpoints; each endpoint a local serving container on a loopback port.

CreateEndpoint downloads the model's ModelDataUrl, starts the container with `serve` and waits for
GET /ping. UpdateEndpoint is a blue/green deployment as SageMaker's: the new (green) container
starts beside the old (blue) one, which keeps serving; once green answers /ping, traffic shifts per
the DeploymentConfig (all at once, canary, linear), each step followed by a baking period during
which the AutoRollbackConfiguration alarms are polled in CloudWatch. An alarm in ALARM sends all
traffic back to blue and retires green (automatic rollback); a green that never answers /ping is
retired the same way. After the final baking period blue is retired. Every endpoint status change
and deployment stage is an EventBridge event; every invocation counts in CloudWatch metrics.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import shutil
import tarfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from atelier.local.sagemaker_common import (
    MODEL_NAME_PATTERN,
    ApiError,
    AwsClients,
    ContainerProcess,
    S3Uri,
    Settings,
    check_name,
    check_volume_key,
    container_env,
    convert_times,
    download,
    epoch_millis,
    free_port,
    log_tail,
    page,
    require,
    utc_now,
    validation_error,
    write_state,
)
from atelier.local.sagemaker_deployments import (
    alarm_names,
    check_deployment_config,
    execution_timeout,
    routing_type,
    traffic_plan,
)
from atelier.local.sagemaker_tags import ResourceTags, checked_tags
from atelier.local.sagemaker_telemetry import Telemetry

logger = logging.getLogger(__name__)

RETIRE_GRACE_SECONDS = 10.0
PING_INTERVAL_SECONDS = 0.2
EVENT_SOURCE = "aws.sagemaker"
ENDPOINT_EVENT = "SageMaker Endpoint State Change"
DEPLOYMENT_EVENT = "SageMaker Endpoint Deployment State Change"
STARTUP_TIMEOUT_RANGE = (60, 3600)  # API_ProductionVariant: ContainerStartupHealthCheckTimeoutInSeconds


def check_startup_timeout(value: Any, number: int) -> None:
    """AWS's range for a variant's startup health-check timeout, refused as AWS refuses it."""
    if value is None:
        return
    low, high = STARTUP_TIMEOUT_RANGE
    field_name = f"productionVariants.{number}.member.containerStartupHealthCheckTimeoutInSeconds"
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        bound = f"greater than or equal to {low}" if isinstance(value, int) and value < low else f"less than or equal to {high}"
        raise validation_error(f"1 validation error detected: Value '{value}' at '{field_name}' failed to satisfy "
                               f"constraint: Member must have value {bound}")


class DeployFailure(Exception):
    """A deployment that cannot go live; the message becomes the endpoint's FailureReason."""


@dataclass
class Model:
    name: str
    arn: str
    request: dict[str, Any]
    creation_time: datetime = field(default_factory=utc_now)

    @property
    def container(self) -> dict[str, Any]:
        return self.request["PrimaryContainer"]

    def describe(self) -> dict[str, Any]:
        echoed: dict[str, Any] = {key: self.request[key] for key in (
            "PrimaryContainer", "ExecutionRoleArn", "VpcConfig", "EnableNetworkIsolation") if key in self.request}
        return {"ModelName": self.name, "ModelArn": self.arn, **echoed, "CreationTime": self.creation_time}

    def summary(self) -> dict[str, Any]:
        return {"ModelName": self.name, "ModelArn": self.arn, "CreationTime": self.creation_time}


@dataclass
class EndpointConfig:
    name: str
    arn: str
    variants: list[dict[str, Any]]
    creation_time: datetime = field(default_factory=utc_now)

    @property
    def variant(self) -> dict[str, Any]:
        return self.variants[0]

    @property
    def instance_count(self) -> int:
        """The first variant's InitialInstanceCount: the fleet size canary and linear steps are measured on."""
        return int(self.variant.get("InitialInstanceCount", 1))

    def describe(self) -> dict[str, Any]:
        return {"EndpointConfigName": self.name, "EndpointConfigArn": self.arn,
                "ProductionVariants": self.variants, "CreationTime": self.creation_time}


@dataclass
class Invocation:
    body: bytes
    content_type: str
    variant: str
    custom_attributes: str | None = None


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


@dataclass
class Deployment:
    """A CreateEndpoint or UpdateEndpoint in flight: the new fleet, its share of the invocations and its
    stage, shown as DescribeEndpoint's PendingDeploymentSummary."""

    config: EndpointConfig
    deployment_config: dict[str, Any] | None
    capacity: int  # the instance count canary and linear sizes are measured on
    start_time: datetime = field(default_factory=utc_now)
    server: Server | None = None
    share: float = 0.0
    stage: str = "Creating"
    stage_message: str = "Launching 1 instance(s)."
    stage_time: datetime = field(default_factory=utc_now)
    _credit: float = 0.0

    def takes_next(self) -> bool:
        """Whether the next invocation goes to the new fleet: exactly `share` of them, evenly spread
        (deterministic, so a test can count them)."""
        if self.server is None or self.share <= 0:
            return False
        self._credit += self.share
        if self._credit >= 1 - 1e-9:
            self._credit -= 1
            return True
        return False

    def summary(self) -> dict[str, Any]:
        variant = self.config.variant
        weight = float(variant.get("InitialVariantWeight", 1.0))
        pending: dict[str, Any] = {
            "VariantName": variant["VariantName"], "CurrentWeight": weight, "DesiredWeight": weight,
            "CurrentInstanceCount": 1 if self.server else 0, "DesiredInstanceCount": 1,
            "VariantStatus": [{"Status": self.stage, "StatusMessage": self.stage_message,
                               "StartTime": self.stage_time}]}
        if variant.get("InstanceType"):
            pending["InstanceType"] = variant["InstanceType"]
        if self.server:
            pending["DeployedImages"] = variant_summary(self.server)["DeployedImages"]
        return {"EndpointConfigName": self.config.name, "StartTime": self.start_time, "ProductionVariants": [pending]}


@dataclass
class Endpoint:
    name: str
    arn: str
    config_name: str
    status: str = "Creating"
    creation_time: datetime = field(default_factory=utc_now)
    last_modified: datetime | None = None
    failure_reason: str | None = None
    server: Server | None = None  # the live (blue) container
    deployment: Deployment | None = None
    deployment_config: dict[str, Any] | None = None  # LastDeploymentConfig
    deleted: threading.Event = field(default_factory=threading.Event)

    def route(self) -> Server | None:
        """The container the next invocation goes to: the new fleet for its share, else the live one."""
        if self.deployment is not None and self.deployment.takes_next():
            return self.deployment.server
        return self.server

    def describe(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "EndpointName": self.name, "EndpointArn": self.arn, "EndpointConfigName": self.config_name,
            "EndpointStatus": self.status, "CreationTime": self.creation_time,
            "LastModifiedTime": self.last_modified or self.creation_time,
        }
        if self.server:
            document["ProductionVariants"] = [variant_summary(self.server)]
        if self.failure_reason:
            document["FailureReason"] = self.failure_reason
        if self.deployment_config:
            document["LastDeploymentConfig"] = self.deployment_config
        if self.deployment:
            document["PendingDeploymentSummary"] = self.deployment.summary()
        return document

    def summary(self) -> dict[str, Any]:
        document = self.describe()
        return {key: document[key] for key in ("EndpointName", "EndpointArn", "CreationTime", "LastModifiedTime",
                                               "EndpointStatus")}


class Hosting:
    """The hosting half of the SageMaker API and the SageMaker Runtime's InvokeEndpoint."""

    def __init__(self, settings: Settings, clients: AwsClients, tags: ResourceTags):
        self._settings = settings
        self._clients = clients
        self._tags = tags
        self._models: dict[str, Model] = {}
        self._configs: dict[str, EndpointConfig] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._servers: set[Server] = set()  # every container started and not yet stopped
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()
        self._closing = False
        self._telemetry = Telemetry(clients, settings.metrics_flush_seconds)

    # --- models ----------------------------------------------------------------------------------

    def create_model(self, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(require(request, "ModelName"), "modelName", MODEL_NAME_PATTERN)
        if "PrimaryContainer" not in request:
            raise validation_error("The local SageMaker supports models with a PrimaryContainer only")
        require(request, "PrimaryContainer.Image")
        if request["PrimaryContainer"].get("ModelDataUrl"):
            S3Uri.parse(request["PrimaryContainer"]["ModelDataUrl"], "ModelDataUrl")
        tags = checked_tags(request.get("Tags"))
        model = Model(name, self._settings.arn("model", name), request)
        with self._lock:
            if name in self._models:
                raise validation_error(f'Cannot create already existing model "{model.arn}".')
            self._models[name] = model
            self._tags.created(model.arn, tags)
        self._persist("models", name, model.describe())
        return {"ModelArn": model.arn}

    def describe_model(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._model(require(request, "ModelName")).describe()

    def list_models(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            summaries = [model.summary() for model in self._models.values()]
        if request.get("NameContains"):
            summaries = [s for s in summaries if request["NameContains"] in s["ModelName"]]
        # botocore sends timestamps as epoch seconds
        if request.get("CreationTimeBefore") is not None:
            summaries = [s for s in summaries if s["CreationTime"].timestamp() < float(request["CreationTimeBefore"])]
        if request.get("CreationTimeAfter") is not None:
            summaries = [s for s in summaries if s["CreationTime"].timestamp() > float(request["CreationTimeAfter"])]
        sort_key = "ModelName" if request.get("SortBy") == "Name" else "CreationTime"
        summaries.sort(key=lambda s: s[sort_key], reverse=request.get("SortOrder", "Descending") == "Descending")
        items, token = page(summaries, request)
        return {"Models": items, **({"NextToken": token} if token else {})}

    def delete_model(self, request: dict[str, Any]) -> dict[str, Any]:
        model = self._model(require(request, "ModelName"))
        name = model.name
        with self._lock:
            self._models.pop(name, None)
            self._tags.deleted(model.arn)
        self._forget("models", name)
        return {}

    # --- endpoint configs -------------------------------------------------------------------------

    def create_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(require(request, "EndpointConfigName"), "endpointConfigName")
        variants = require(request, "ProductionVariants")
        if not variants:
            raise validation_error("1 validation error detected: Value '[]' at 'productionVariants' failed to satisfy "
                                   "constraint: Member must have length greater than or equal to 1")
        for number, variant in enumerate(variants, 1):
            require(variant, "VariantName")
            self._model(require(variant, "ModelName"))
            check_startup_timeout(variant.get("ContainerStartupHealthCheckTimeoutInSeconds"), number)
            if variant.get("InstanceType"):  # serverless variants have none
                check_volume_key(variant["InstanceType"], request.get("KmsKeyId"), "KmsKeyId")
        tags = checked_tags(request.get("Tags"))
        config = EndpointConfig(name, self._settings.arn("endpoint-config", name), variants)
        with self._lock:
            if name in self._configs:
                raise validation_error(f'Cannot create already existing endpoint configuration "{config.arn}".')
            self._configs[name] = config
            self._tags.created(config.arn, tags)
        self._persist("endpoint-configs", name, config.describe())
        return {"EndpointConfigArn": config.arn}

    def describe_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._config(require(request, "EndpointConfigName")).describe()

    def delete_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        config = self._config(require(request, "EndpointConfigName"))
        name = config.name
        with self._lock:
            self._configs.pop(name, None)
            self._tags.deleted(config.arn)
        self._forget("endpoint-configs", name)
        return {}

    # --- endpoints --------------------------------------------------------------------------------

    def create_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(require(request, "EndpointName"), "endpointName")
        config = self._config(require(request, "EndpointConfigName"))
        # Kept for later updates (RetainDeploymentConfig); a create itself is never blue/green.
        deployment_config = self._checked_deployment_config(request.get("DeploymentConfig"), config.instance_count)
        tags = checked_tags(request.get("Tags"))
        endpoint = Endpoint(name, self._settings.arn("endpoint", name), config.name,
                            deployment_config=deployment_config)
        with self._lock:
            self._refuse_when_closing()
            if name in self._endpoints:
                raise validation_error(f'Cannot create already existing endpoint "{endpoint.arn}".')
            self._endpoints[name] = endpoint
            self._tags.created(endpoint.arn, tags)
            endpoint.deployment = Deployment(config, None, config.instance_count)
            self._changed(endpoint)
            self._start_deployment(endpoint, endpoint.deployment)
        return {"EndpointArn": endpoint.arn}

    def describe_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._endpoint(require(request, "EndpointName")).describe()

    def update_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        config = self._config(require(request, "EndpointConfigName"))
        endpoint = self._endpoint(require(request, "EndpointName"))
        if request.get("DeploymentConfig") is not None and request.get("RetainDeploymentConfig"):
            raise validation_error("DeploymentConfig cannot be specified when RetainDeploymentConfig is true.")
        retained = self._config(endpoint.config_name) if request.get("RetainAllVariantProperties") else config
        if request.get("RetainDeploymentConfig"):
            deployment_config = endpoint.deployment_config
        else:
            deployment_config = self._checked_deployment_config(request.get("DeploymentConfig"),
                                                                retained.instance_count)
        with self._lock:
            self._refuse_when_closing()
            endpoint = self._endpoint(endpoint.name)
            if endpoint.status != "InService":
                state = "failed" if endpoint.status == "Failed" else "in-progress"
                raise validation_error(f'Cannot update {state} endpoint "{endpoint.arn}".')
            endpoint.status, endpoint.failure_reason, endpoint.last_modified = "Updating", None, utc_now()
            endpoint.deployment_config = deployment_config
            endpoint.deployment = Deployment(config, deployment_config, retained.instance_count)
            self._changed(endpoint)
            self._start_deployment(endpoint, endpoint.deployment)
        return {"EndpointArn": endpoint.arn}

    def delete_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            endpoint = self._endpoint(require(request, "EndpointName"))
            del self._endpoints[endpoint.name]
            endpoint.deleted.set()  # a deployment in flight stops its new container itself
            endpoint.status, endpoint.deployment, endpoint.last_modified = "Deleting", None, utc_now()
            self._announce(endpoint, ENDPOINT_EVENT)
            self._tags.deleted(endpoint.arn)  # after its last event, which carries them
            server, endpoint.server = endpoint.server, None
            self._endpoint_file(endpoint.name).unlink(missing_ok=True)
        if server:
            self._in_background(self._retire, server, name=f"retire-{endpoint.name}")
        return {}

    def list_endpoints(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            summaries = [endpoint.summary() for endpoint in self._endpoints.values()]
        if request.get("NameContains"):
            summaries = [s for s in summaries if request["NameContains"] in s["EndpointName"]]
        if request.get("StatusEquals"):
            summaries = [s for s in summaries if s["EndpointStatus"] == request["StatusEquals"]]
        sort_key = {"Name": "EndpointName", "Status": "EndpointStatus"}.get(request.get("SortBy", ""), "CreationTime")
        summaries.sort(key=lambda s: s[sort_key], reverse=request.get("SortOrder", "Descending") == "Descending")
        items, token = page(summaries, request)
        return {"Endpoints": items, **({"NextToken": token} if token else {})}

    # --- runtime ----------------------------------------------------------------------------------

    def invoke(self, name: str, body: bytes, headers: dict[str, str]) -> Invocation:
        """InvokeEndpoint: forward to the container the endpoint routes to; its errors come back as
        ModelError. Counted in the endpoint's metrics, which a background thread sends."""
        with self._lock:
            endpoint = self._endpoints.get(name)
            server = endpoint.route() if endpoint else None
            if server is None:
                raise ApiError("ValidationError", f"Endpoint {name} of account {self._settings.account_id} not found.")
            server.enter()  # counted before the lock is released, so a switch-over drains it
        started = time.perf_counter()
        try:
            status, reply_headers, reply = self._forward(server, name, body, headers)
        except ApiError:  # a timeout or a broken connection: the container failed the request
            self._telemetry.record_invocation(name, server.variant, 500, time.perf_counter() - started)
            raise
        finally:
            server.leave()
        self._telemetry.record_invocation(name, server.variant, status, time.perf_counter() - started)
        if not 200 <= status < 300:
            raise self._model_error(name, status, reply)
        return Invocation(reply, reply_headers.get("content-type", "application/octet-stream"), server.variant,
                          reply_headers.get("x-amzn-sagemaker-custom-attributes"))

    def _forward(self, server: Server, name: str, body: bytes,
                 headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        timeout = self._settings.invoke_timeout_seconds
        try:
            return server.invoke(body, headers, timeout)
        except TimeoutError:
            raise ApiError("ModelError", "Your invocation timed out while waiting for a response from container "
                           f"primary after {timeout:g} seconds.", 424, self._log_fields(name)) from None
        except OSError as error:
            raise self._model_error(name, 500, str(error).encode()) from None

    def _model_error(self, name: str, status: int, reply: bytes) -> ApiError:
        kind = "client" if 400 <= status < 500 else "server"
        text = reply.decode("utf-8", "replace")[:1024]
        message = (f'Received {kind} error ({status}) from primary with message "{text}". '
                   f"See the container log under {self._settings.state_dir / 'endpoints' / name} for more.")
        fields = {"OriginalStatusCode": status, "OriginalMessage": text, **self._log_fields(name)}
        return ApiError("ModelError", message, 424, fields)

    def _log_fields(self, name: str) -> dict[str, str]:
        return {"LogStreamArn": f"arn:aws:logs:{self._settings.region}:{self._settings.account_id}:log-group:"
                                f"/aws/sagemaker/Endpoints/{name}"}

    # --- shutdown ---------------------------------------------------------------------------------

    def close(self, grace_seconds: float) -> None:
        """Stop every serving container, including ones still starting, and wait for them."""
        with self._lock:
            self._closing = True
            for endpoint in self._endpoints.values():
                endpoint.deleted.set()
            servers, threads = list(self._servers), list(self._threads)
        stoppers = [threading.Thread(target=self._retire, args=(server, grace_seconds, 0.0)) for server in servers]
        for thread in stoppers:
            thread.start()
        for thread in [*stoppers, *threads]:
            thread.join(timeout=grace_seconds + 30)
        self._telemetry.close()  # the last events and metrics, while moto is still up

    # --- deployments ------------------------------------------------------------------------------

    def _start_deployment(self, endpoint: Endpoint, deployment: Deployment) -> None:
        self._in_background(self._deploy, endpoint, deployment,
                            name=f"deploy-{endpoint.name}-{deployment.config.name}")

    def _deploy(self, endpoint: Endpoint, deployment: Deployment) -> None:
        try:
            server = self._launch(endpoint, deployment.config)
        except DeployFailure as failure:
            self._deployment_failed(endpoint, deployment, str(failure))
        except Exception as error:  # the runner broke: report it on the endpoint
            logger.exception("deploying %s to %s failed", deployment.config.name, endpoint.name)
            self._deployment_failed(endpoint, deployment, f"InternalFailure: local runner: {error}")
        else:
            self._roll_out(endpoint, deployment, server)

    def _launch(self, endpoint: Endpoint, config: EndpointConfig) -> Server:
        """Model data into <root>/opt_ml/model, then the container, then /ping until it answers."""
        if len(config.variants) != 1:
            raise DeployFailure("The local SageMaker supports endpoint configs with one ProductionVariant")
        variant = config.variants[0]
        with self._lock:
            model = self._models.get(variant["ModelName"])
        if model is None:
            raise DeployFailure(f'Could not find model "{self._settings.arn("model", variant["ModelName"])}".')
        root = self._deployment_root(endpoint.name, config.name)
        self._unpack_model(model, root)
        server = self._start_server(model, root, config.name, variant["VariantName"])
        timeout = variant.get("ContainerStartupHealthCheckTimeoutInSeconds", self._settings.startup_timeout_seconds)
        try:
            server.wait_until_healthy(timeout, endpoint.deleted)
        except DeployFailure:
            self._retire(server, RETIRE_GRACE_SECONDS, 0.0)
            raise
        return server

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
            "ATELIER_OPT_ML": str(root / "opt_ml"), "SAGEMAKER_BIND_TO_PORT": str(port), "SAGEMAKER_BIND_HOST": "127.0.0.1"})
        try:
            process = ContainerProcess(argv, env, self._settings.cwd, root / "logs.txt")
        except OSError as error:
            raise DeployFailure(f"Cannot start the container {argv}: {error}") from error
        server = Server(process, port=port, root=root, config=config, variant=variant, image=image)
        with self._lock:
            self._servers.add(server)
        return server

    def _roll_out(self, endpoint: Endpoint, deployment: Deployment, server: Server) -> None:
        """Shift traffic to the healthy new container step by step, baking after each step while the
        rollback alarms are polled; then retire the old container, or on an alarm roll back."""
        with self._lock:
            if endpoint.deployment is not deployment:  # deleted while deploying: nobody will route to it
                retired: Server | None = server
            else:
                deployment.server, retired = server, None
        if retired:
            return self._retire(server)
        if endpoint.server is None:  # a create: nothing to shift traffic from
            return self._complete(endpoint, deployment)
        config = deployment.deployment_config
        alarms = alarm_names(config)
        timeout = execution_timeout(config)
        elapsed = (utc_now() - deployment.start_time).total_seconds()
        deadline = time.monotonic() - elapsed + timeout if timeout else None
        partial = "canary capacity" if routing_type(config) == "CANARY" else "partial capacity"
        for step in traffic_plan(config, deployment.capacity):
            capacity = "full capacity" if step.share >= 1 else f"{partial} of {step.share:.0%} of invocations"
            self._set_stage(endpoint, deployment, "ActivatingTraffic", f"Activating traffic on {capacity}.",
                            share=step.share)
            if step.bake_seconds:
                self._set_stage(endpoint, deployment, "Baking", f"Baking for {step.bake_seconds} seconds "
                                f"({step.bake_member}) with traffic enabled on {capacity}.")
            reason = self._bake(endpoint, step.bake_seconds, alarms, deadline)
            if endpoint.deleted.is_set():
                return self._retire(server)
            if reason:
                return self._roll_back(endpoint, deployment, reason)
        self._complete(endpoint, deployment)

    def _bake(self, endpoint: Endpoint, seconds: float, alarms: list[str], deadline: float | None) -> str | None:
        """Wait out a baking period polling the alarms (once at least); why to roll back, or None."""
        end = time.monotonic() + seconds
        while True:
            firing = self._alarms_firing(alarms)
            if firing:
                return (f"Rolled back: CloudWatch alarm(s) {', '.join(firing)} in the AutoRollbackConfiguration "
                        "went into ALARM during the deployment.")
            if deadline is not None and time.monotonic() >= deadline:
                return "Rolled back: the deployment exceeded MaximumExecutionTimeoutInSeconds."
            remaining = end - time.monotonic()
            if remaining <= 0 or endpoint.deleted.wait(min(remaining, self._settings.alarm_poll_seconds)):
                return None

    def _alarms_firing(self, names: list[str]) -> list[str]:
        """The named alarms now in ALARM (DescribeAlarms on CloudWatch); none when CloudWatch cannot answer."""
        if not names:
            return []
        try:
            states = self._alarm_states(names)
        except Exception:  # an unreachable CloudWatch does not roll a deployment back
            logger.warning("could not read the rollback alarms %s", names, exc_info=True)
            return []
        return sorted(name for name, state in states.items() if state == "ALARM")

    def _alarm_states(self, names: list[str]) -> dict[str, str]:
        answer = self._clients.get("cloudwatch").describe_alarms(AlarmNames=names)
        alarms = [*answer.get("MetricAlarms", []), *answer.get("CompositeAlarms", [])]
        return {alarm["AlarmName"]: alarm["StateValue"] for alarm in alarms}

    def _set_stage(self, endpoint: Endpoint, deployment: Deployment, stage: str, message: str,
                   share: float | None = None) -> None:
        with self._lock:
            if endpoint.deployment is not deployment:
                return
            deployment.stage, deployment.stage_message, deployment.stage_time = stage, message, utc_now()
            if share is not None:
                deployment.share = share
            self._persist_endpoint(endpoint)
            self._announce(endpoint, DEPLOYMENT_EVENT)

    def _complete(self, endpoint: Endpoint, deployment: Deployment) -> None:
        """All traffic on the new container, which becomes the live one; the old one is retired."""
        with self._lock:
            if endpoint.deployment is not deployment:
                retired = deployment.server
            else:
                retired, endpoint.server = endpoint.server, deployment.server
                endpoint.config_name, endpoint.status, endpoint.deployment = deployment.config.name, "InService", None
                endpoint.failure_reason, endpoint.last_modified = None, utc_now()
                self._changed(endpoint)
        if retired:
            self._retire(retired)

    def _roll_back(self, endpoint: Endpoint, deployment: Deployment, reason: str) -> None:
        """All traffic back to the old container at once, the new one retired, the endpoint InService on
        its previous config with the reason as FailureReason."""
        with self._lock:
            if endpoint.deployment is deployment:
                deployment.share = 0.0
                self._set_stage(endpoint, deployment, "Deleting", f"Terminating 1 instance(s). {reason}")
                endpoint.status, endpoint.deployment = "InService", None
                endpoint.failure_reason, endpoint.last_modified = reason, utc_now()
                self._changed(endpoint)
        logger.warning("endpoint %s: %s", endpoint.name, reason)
        if deployment.server:
            self._retire(deployment.server)

    def _deployment_failed(self, endpoint: Endpoint, deployment: Deployment, reason: str) -> None:
        """A failed create leaves the endpoint Failed; a failed update keeps the old container serving."""
        with self._lock:
            if endpoint.deployment is not deployment:
                return
            endpoint.status = "InService" if endpoint.server else "Failed"
            endpoint.deployment = None
            endpoint.failure_reason, endpoint.last_modified = reason[:1024], utc_now()
            self._changed(endpoint)
        logger.warning("endpoint %s: %s", endpoint.name, reason)

    def _retire(self, server: Server, grace: float = RETIRE_GRACE_SECONDS, drain: float | None = None) -> None:
        server.stop(grace, self._settings.invoke_timeout_seconds if drain is None else drain)
        with self._lock:
            self._servers.discard(server)

    def _in_background(self, target: Any, *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    # --- lookups and state files ------------------------------------------------------------------

    def _model(self, name: str) -> Model:
        with self._lock:
            model = self._models.get(name)
        if model is None:
            raise validation_error(f'Could not find model "{self._settings.arn("model", name)}".')
        return model

    def _config(self, name: str) -> EndpointConfig:
        with self._lock:
            config = self._configs.get(name)
        if config is None:
            raise validation_error(
                f'Could not find endpoint configuration "{self._settings.arn("endpoint-config", name)}".')
        return config

    def _endpoint(self, name: str) -> Endpoint:
        with self._lock:
            endpoint = self._endpoints.get(name)
        if endpoint is None:
            raise validation_error(f'Could not find endpoint "{self._settings.arn("endpoint", name)}".')
        return endpoint

    def _checked_deployment_config(self, config: Any, instance_count: int) -> dict[str, Any] | None:
        """A DeploymentConfig as the API checks it, its rollback alarms included (they must exist)."""
        if config is None:
            return None
        check_deployment_config(config, instance_count)
        names = alarm_names(config)
        if names:
            known = self._alarm_states(names)
            missing = [name for name in names if name not in known]
            if missing:
                raise validation_error(f"The following CloudWatch alarms in the AutoRollbackConfiguration do not "
                                       f"exist: {', '.join(missing)}.")
        return config

    def _refuse_when_closing(self) -> None:
        if self._closing:
            raise ApiError("ServiceUnavailable", "The local SageMaker is shutting down", 503)

    def _persist(self, kind: str, name: str, document: dict[str, Any]) -> None:
        write_state(self._settings.state_dir / kind / f"{name}.json", document)

    def _forget(self, kind: str, name: str) -> None:
        (self._settings.state_dir / kind / f"{name}.json").unlink(missing_ok=True)

    def _persist_endpoint(self, endpoint: Endpoint) -> None:
        """Called under the lock, so files change in the order the endpoint did."""
        write_state(self._endpoint_file(endpoint.name), endpoint.describe())

    def _changed(self, endpoint: Endpoint) -> None:
        """The endpoint's status changed: its state file and its event. Called under the lock, so
        events are queued in the order of the changes."""
        self._persist_endpoint(endpoint)
        self._announce(endpoint, ENDPOINT_EVENT)

    def _announce(self, endpoint: Endpoint, detail_type: str) -> None:
        """Queue the event; the detail is the Describe document as SageMaker's events carry it."""
        detail = convert_times({**endpoint.describe(), "Tags": self._tags.of(endpoint.arn)}, epoch_millis)
        detail["EndpointStatus"] = event_status(endpoint.status)
        self._telemetry.put_event({"Source": EVENT_SOURCE, "DetailType": detail_type, "Resources": [endpoint.arn],
                                   "Detail": json.dumps(detail)})

    def _endpoint_file(self, name: str) -> Path:
        return self._settings.state_dir / "endpoints" / name / "endpoint.json"


def variant_summary(server: Server) -> dict[str, Any]:
    return {"VariantName": server.variant,
            "DeployedImages": [{"SpecifiedImage": server.image, "ResolvedImage": server.image,
                                "ResolutionTime": server.started}],
            "CurrentWeight": 1.0, "DesiredWeight": 1.0, "CurrentInstanceCount": 1, "DesiredInstanceCount": 1}


def event_status(status: str) -> str:
    """Endpoint events spell the status in capitals (InService -> IN_SERVICE), as AWS's examples show."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", status).upper()
