"""What the local endpoints tell the rest of AWS: EventBridge events and CloudWatch metrics.

One background thread puts both on moto, so neither an API call nor an invocation ever waits on a
network call: events leave in the order they were queued, invocation metrics are summed per
endpoint and variant and flushed every `flush_seconds` as statistic sets (what SageMaker publishes
once a minute: AWS/SageMaker, EndpointName + VariantName, Invocations, Invocation4XXErrors,
Invocation5XXErrors, ModelLatency in microseconds). A failed put is logged and dropped, as a lost
event or datapoint would be on AWS; it never breaks an endpoint.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.documents import utc_now

logger = logging.getLogger(__name__)

NAMESPACE = "AWS/SageMaker"
MAX_DATUMS = 500  # per PutMetricData call, well under CloudWatch's limit
_STOP = object()


@dataclass
class _Tally:
    """One endpoint variant's invocations since the last flush."""

    count: int = 0
    client_errors: int = 0
    server_errors: int = 0
    latency_sum: float = 0.0
    latency_min: float = float("inf")
    latency_max: float = 0.0

    def add(self, status: int, latency_us: float) -> None:
        self.count += 1
        self.client_errors += 400 <= status < 500
        self.server_errors += status >= 500
        self.latency_sum += latency_us
        self.latency_min = min(self.latency_min, latency_us)
        self.latency_max = max(self.latency_max, latency_us)

    def datums(self, endpoint: str, variant: str) -> list[dict[str, Any]]:
        dimensions = [{"Name": "EndpointName", "Value": endpoint}, {"Name": "VariantName", "Value": variant}]
        timestamp = utc_now()

        def datum(name: str, total: float, low: float, high: float, unit: str) -> dict[str, Any]:
            return {"MetricName": name, "Dimensions": dimensions, "Timestamp": timestamp, "Unit": unit,
                    "StatisticValues": {"SampleCount": self.count, "Sum": total, "Minimum": low, "Maximum": high}}

        def errors(name: str, total: int) -> dict[str, Any]:
            # One 0-or-1 sample per invocation, so Average is the error rate (what rollback alarms use).
            return datum(name, total, 0.0 if total < self.count else 1.0, 1.0 if total else 0.0, "None")

        return [datum("Invocations", self.count, 1.0, 1.0, "None"),
                errors("Invocation4XXErrors", self.client_errors),
                errors("Invocation5XXErrors", self.server_errors),
                datum("ModelLatency", self.latency_sum, self.latency_min, self.latency_max, "Microseconds")]


class Telemetry:
    """Queues events and tallies invocations; a daemon thread started on first use sends them."""

    def __init__(self, clients: AwsClients, flush_seconds: float = 1.0):
        self._clients = clients
        self._flush_seconds = flush_seconds
        self._events: queue.Queue[Any] = queue.Queue()
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put_event(self, entry: dict[str, Any]) -> None:
        """An EventBridge PutEvents entry, sent after every entry queued before it."""
        self._ensure_started()
        self._events.put(entry)

    def record_invocation(self, endpoint: str, variant: str, status: int, latency_seconds: float) -> None:
        """Count one invocation answered with `status` by the container (5xx for a timeout or broken
        connection) after `latency_seconds`; no network call here."""
        self._ensure_started()
        with self._lock:
            self._tallies.setdefault((endpoint, variant), _Tally()).add(status, latency_seconds * 1e6)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued and tallied, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._events.put(_STOP)
            thread.join(timeout)

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sagemaker-telemetry", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        next_flush = time.monotonic() + self._flush_seconds
        while True:
            try:
                entry = self._events.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                entry = None
            if entry is _STOP:
                self._drain_events()
                self._flush_metrics()
                return
            if entry is not None:
                self._send_event(entry)
            if time.monotonic() >= next_flush:
                self._flush_metrics()
                next_flush = time.monotonic() + self._flush_seconds

    def _drain_events(self) -> None:
        while True:
            try:
                entry = self._events.get_nowait()
            except queue.Empty:
                return
            if entry is not _STOP:
                self._send_event(entry)

    def _send_event(self, entry: dict[str, Any]) -> None:
        try:
            response = self._clients.get("events").put_events(Entries=[entry])
            if response.get("FailedEntryCount"):
                logger.warning("event %s not accepted: %s", entry["DetailType"], response["Entries"])
        except Exception:  # a down event bus must not break an endpoint
            logger.warning("could not put a %s event", entry["DetailType"], exc_info=True)

    def _flush_metrics(self) -> None:
        with self._lock:
            tallies, self._tallies = self._tallies, {}
        datums = [datum for (endpoint, variant), tally in tallies.items() for datum in tally.datums(endpoint, variant)]
        for start in range(0, len(datums), MAX_DATUMS):
            batch = datums[start:start + MAX_DATUMS]
            try:
                self._clients.get("cloudwatch").put_metric_data(Namespace=NAMESPACE, MetricData=batch)
            except Exception:  # lost datapoints are missing data to an alarm, as on AWS
                logger.warning("could not put %d endpoint metrics", len(batch), exc_info=True)
