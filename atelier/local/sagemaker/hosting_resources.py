"""The hosting resources as the API describes them: models, endpoint configs, endpoints, invocations.

Plain data. The API (endpoints.py) keeps them and answers their Describe and List shapes; the
rollout (rollout.py) moves an endpoint from one config to the next; an endpoint's containers are
the supervisor's (serving.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from atelier.local.sagemaker.documents import utc_now

if TYPE_CHECKING:  # for annotations only: both modules import this one
    from atelier.local.sagemaker.rollout import Deployment
    from atelier.local.sagemaker.serving import Server


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


def variant_summary(server: Server) -> dict[str, Any]:
    return {"VariantName": server.variant,
            "DeployedImages": [{"SpecifiedImage": server.image, "ResolvedImage": server.image,
                                "ResolutionTime": server.started}],
            "CurrentWeight": 1.0, "DesiredWeight": 1.0, "CurrentInstanceCount": 1, "DesiredInstanceCount": 1}
