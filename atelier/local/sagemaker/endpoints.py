"""Models, endpoint configs, endpoints and InvokeEndpoint: the hosting half of the SageMaker API.

Request checks and answers. An endpoint's containers are the supervisor's (serving.py); its move
from one config to the next, blue/green, is the rollout's (rollout.py); its state files and events
are hosting_reports.py's; every invocation counts in CloudWatch metrics (telemetry.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.deployment_config import check_deployment_config
from atelier.local.sagemaker.documents import utc_now
from atelier.local.sagemaker.hosting_reports import ENDPOINT_EVENT, HostingReports
from atelier.local.sagemaker.hosting_resources import Endpoint, EndpointConfig, Invocation, Model
from atelier.local.sagemaker.rollout import Deployment, Rollout
from atelier.local.sagemaker.s3_transfers import S3Uri
from atelier.local.sagemaker.serving import Server, Supervisor
from atelier.local.sagemaker.settings import Settings
from atelier.local.sagemaker.tags import ResourceTags, checked_tags
from atelier.local.sagemaker.telemetry import Telemetry
from atelier.local.sagemaker.validation import (
    ApiError,
    check_model_environment_size,
    check_volume_key,
    not_emulated,
    listing,
    validation_error,
)


class Hosting:
    """The hosting half of the SageMaker API and the SageMaker Runtime's InvokeEndpoint."""

    def __init__(self, settings: Settings, clients: AwsClients, tags: ResourceTags):
        self._settings = settings
        self._tags = tags
        self._models: dict[str, Model] = {}
        self._configs: dict[str, EndpointConfig] = {}
        self._endpoints: dict[str, Endpoint] = {}
        # Guards the resources and every endpoint's fields, the rollout's changes to them included.
        self._lock = threading.RLock()
        self._closing = False
        self._telemetry = Telemetry(clients, settings.metrics_flush_seconds)
        self._reports = HostingReports(settings, tags, self._telemetry)
        self._supervisor = Supervisor(settings, clients)
        self._rollout = Rollout(settings, clients, self._lock, self._supervisor, self._reports, self._find_model)

    # --- models ----------------------------------------------------------------------------------

    def create_model(self, request: dict[str, Any]) -> dict[str, Any]:
        name = request["ModelName"]
        if not (request.get("PrimaryContainer") or {}).get("Image"):
            raise not_emulated("a model without PrimaryContainer.Image (Containers, ModelPackageName)")
        if request["PrimaryContainer"].get("ModelDataUrl"):
            S3Uri.parse(request["PrimaryContainer"]["ModelDataUrl"], "ModelDataUrl")
        check_model_environment_size(request["PrimaryContainer"].get("Environment") or {})
        tags = checked_tags(request.get("Tags"))
        model = Model(name, self._settings.arn("model", name), request)
        with self._lock:
            if name in self._models:
                raise validation_error(f'Cannot create already existing model "{model.arn}".')
            self._models[name] = model
            self._tags.created(model.arn, tags)
        self._reports.saved("models", name, model.describe())
        return {"ModelArn": model.arn}

    def describe_model(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._model(request["ModelName"]).describe()

    def list_models(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            summaries = [model.summary() for model in self._models.values()]
        return listing(summaries, request, "Model", "Models", "Descending")

    def delete_model(self, request: dict[str, Any]) -> dict[str, Any]:
        model = self._model(request["ModelName"])
        name = model.name
        with self._lock:
            self._models.pop(name, None)
            self._tags.deleted(model.arn)
        self._reports.removed("models", name)
        return {}

    # --- endpoint configs -------------------------------------------------------------------------

    def create_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        name, variants = request["EndpointConfigName"], request["ProductionVariants"]
        for variant in variants:
            if not variant.get("ModelName"):
                raise not_emulated("a production variant without ModelName (inference components)")
            self._model(variant["ModelName"])
            if variant.get("InstanceType"):  # serverless variants have none
                check_volume_key(variant["InstanceType"], request.get("KmsKeyId"), "KmsKeyId")
        tags = checked_tags(request.get("Tags"))
        config = EndpointConfig(name, self._settings.arn("endpoint-config", name), variants)
        with self._lock:
            if name in self._configs:
                raise validation_error(f'Cannot create already existing endpoint configuration "{config.arn}".')
            self._configs[name] = config
            self._tags.created(config.arn, tags)
        self._reports.saved("endpoint-configs", name, config.describe())
        return {"EndpointConfigArn": config.arn}

    def describe_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._config(request["EndpointConfigName"]).describe()

    def delete_endpoint_config(self, request: dict[str, Any]) -> dict[str, Any]:
        config = self._config(request["EndpointConfigName"])
        name = config.name
        with self._lock:
            self._configs.pop(name, None)
            self._tags.deleted(config.arn)
        self._reports.removed("endpoint-configs", name)
        return {}

    # --- endpoints --------------------------------------------------------------------------------

    def create_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        name = request["EndpointName"]
        config = self._config(request["EndpointConfigName"])
        # Kept for later updates (RetainDeploymentConfig); a create itself is never blue/green.
        deployment_config = check_deployment_config(request.get("DeploymentConfig"), config.instance_count)
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
            self._reports.endpoint_changed(endpoint)
            self._rollout.start(endpoint, endpoint.deployment)
        return {"EndpointArn": endpoint.arn}

    def describe_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._endpoint(request["EndpointName"]).describe()

    def update_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        config = self._config(request["EndpointConfigName"])
        endpoint = self._endpoint(request["EndpointName"])
        retained = self._config(endpoint.config_name) if request.get("RetainAllVariantProperties") else config
        if request.get("RetainDeploymentConfig"):
            deployment_config = endpoint.deployment_config
        else:
            deployment_config = check_deployment_config(request.get("DeploymentConfig"), retained.instance_count)
        with self._lock:
            self._refuse_when_closing()
            endpoint = self._endpoint(endpoint.name)
            # API reference, DescribeEndpoint.EndpointStatus: a Failed endpoint takes DeleteEndpoint only;
            # one Creating or Updating is refused as AWS refuses it ("Cannot update in-progress endpoint")
            if endpoint.status != "InService":
                state = "failed" if endpoint.status == "Failed" else "in-progress"
                raise validation_error(f'Cannot update {state} endpoint "{endpoint.arn}".')
            endpoint.status, endpoint.failure_reason, endpoint.last_modified = "Updating", None, utc_now()
            endpoint.deployment_config = deployment_config
            endpoint.deployment = Deployment(config, deployment_config, retained.instance_count)
            self._reports.endpoint_changed(endpoint)
            self._rollout.start(endpoint, endpoint.deployment)
        return {"EndpointArn": endpoint.arn}

    def delete_endpoint(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            endpoint = self._endpoint(request["EndpointName"])
            del self._endpoints[endpoint.name]
            endpoint.deleted.set()  # a deployment in flight stops its new container itself
            endpoint.status, endpoint.deployment, endpoint.last_modified = "Deleting", None, utc_now()
            self._reports.announce(endpoint, ENDPOINT_EVENT)
            self._tags.deleted(endpoint.arn)  # after its last event, which carries them
            server, endpoint.server = endpoint.server, None
            self._reports.endpoint_removed(endpoint.name)
        if server:
            self._supervisor.in_background(self._supervisor.retire, server, name=f"retire-{endpoint.name}")
        return {}

    def list_endpoints(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            summaries = [endpoint.summary() for endpoint in self._endpoints.values()]
        return listing(summaries, request, "Endpoint", "Endpoints", "Descending")

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
        """Refuse new endpoints, stop every serving container (ones still starting too) and wait for them."""
        with self._lock:
            self._closing = True
            for endpoint in self._endpoints.values():
                endpoint.deleted.set()
        self._supervisor.close(grace_seconds)
        self._telemetry.close()  # the last events and metrics, while moto is still up

    # --- lookups -----------------------------------------------------------------------------------

    def _model(self, name: str) -> Model:
        with self._lock:
            model = self._models.get(name)
        if model is None:
            raise validation_error(f'Could not find model "{self._settings.arn("model", name)}".')
        return model

    def _find_model(self, name: str) -> Model | None:
        with self._lock:
            return self._models.get(name)

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

    def _refuse_when_closing(self) -> None:
        if self._closing:
            raise ApiError("ServiceUnavailable", "The local SageMaker is shutting down", 503)
