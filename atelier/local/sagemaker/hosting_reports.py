"""What the hosting resources leave behind: their state files under state_dir and the endpoint events.

State files are for humans and `atelier` status commands (<state>/models/<name>.json,
<state>/endpoint-configs/<name>.json, <state>/endpoints/<name>/endpoint.json). Every endpoint status
change and deployment stage is an EventBridge event whose detail is the DescribeEndpoint document,
queued on the telemetry thread. The endpoint methods are called under the hosting lock, so files
change, and events are queued, in the order the endpoint changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from atelier.local.sagemaker.documents import convert_times, epoch_millis, write_state
from atelier.local.sagemaker.hosting_resources import Endpoint
from atelier.local.sagemaker.settings import Settings
from atelier.local.sagemaker.tags import ResourceTags
from atelier.local.sagemaker.telemetry import Telemetry

EVENT_SOURCE = "aws.sagemaker"
ENDPOINT_EVENT = "SageMaker Endpoint State Change"
DEPLOYMENT_EVENT = "SageMaker Endpoint Deployment State Change"


class HostingReports:
    """Writes the state files and queues the endpoint events."""

    def __init__(self, settings: Settings, tags: ResourceTags, telemetry: Telemetry):
        self._settings = settings
        self._tags = tags
        self._telemetry = telemetry

    def saved(self, kind: str, name: str, document: dict[str, Any]) -> None:
        """A model's or endpoint config's state file (kind: models, endpoint-configs)."""
        write_state(self._settings.state_dir / kind / f"{name}.json", document)

    def removed(self, kind: str, name: str) -> None:
        (self._settings.state_dir / kind / f"{name}.json").unlink(missing_ok=True)

    def endpoint_changed(self, endpoint: Endpoint) -> None:
        """The endpoint's status changed: its state file and its event."""
        self._save_endpoint(endpoint)
        self.announce(endpoint, ENDPOINT_EVENT)

    def deployment_changed(self, endpoint: Endpoint) -> None:
        """The stage of the endpoint's deployment changed: its state file and the deployment event."""
        self._save_endpoint(endpoint)
        self.announce(endpoint, DEPLOYMENT_EVENT)

    def endpoint_removed(self, name: str) -> None:
        self._endpoint_file(name).unlink(missing_ok=True)

    def announce(self, endpoint: Endpoint, detail_type: str) -> None:
        """Queue the event; the detail is the Describe document as SageMaker's events carry it."""
        detail = convert_times({**endpoint.describe(), "Tags": self._tags.of(endpoint.arn)}, epoch_millis)
        detail["EndpointStatus"] = event_status(endpoint.status)
        self._telemetry.put_event({"Source": EVENT_SOURCE, "DetailType": detail_type, "Resources": [endpoint.arn],
                                   "Detail": json.dumps(detail)})

    def _save_endpoint(self, endpoint: Endpoint) -> None:
        write_state(self._endpoint_file(endpoint.name), endpoint.describe())

    def _endpoint_file(self, name: str) -> Path:
        return self._settings.state_dir / "endpoints" / name / "endpoint.json"


def event_status(status: str) -> str:
    """Endpoint events spell the status in capitals (InService -> IN_SERVICE), as AWS's examples show."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", status).upper()
