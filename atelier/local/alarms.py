"""A local CloudWatch alarm evaluator: moto stores metric alarms and metrics but never evaluates them.

`evaluate` is the pure rule: given a single-metric alarm (as DescribeAlarms returns it) and its
statistic for each of the last EvaluationPeriods periods, which state the alarm should be in.
`AlarmEvaluator` is the loop the local stack runs: every `interval_seconds` it reads every metric
alarm, asks GetMetricStatistics for each period and calls SetAlarmState when the state changes, so
alarms on the local endpoints' metrics fire as they would on AWS (and SageMaker deployments that
watch them roll back).

    evaluator = AlarmEvaluator(region="us-east-1", interval_seconds=5)
    evaluator.start()   # after AWS_ENDPOINT_URL points at moto
    ...
    evaluator.stop()

Differences from CloudWatch, on purpose: the periods are the last EvaluationPeriods x Period seconds
ending now (a sliding window, so a local alarm reacts within seconds rather than after a period
closes); with TreatMissingData `missing` (the default) only the periods that have data count, and
the alarm is INSUFFICIENT_DATA when none do (CloudWatch also looks further back for data). Metric
math alarms, percentile statistics (ExtendedStatistic) and anomaly-detection operators are skipped.
"""

from __future__ import annotations

import json
import logging
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3

logger = logging.getLogger(__name__)

OPERATORS: dict[str, tuple[Callable[[float, float], bool], str]] = {
    "GreaterThanOrEqualToThreshold": (operator.ge, "greater than or equal to"),
    "GreaterThanThreshold": (operator.gt, "greater than"),
    "LessThanThreshold": (operator.lt, "less than"),
    "LessThanOrEqualToThreshold": (operator.le, "less than or equal to"),
}
STATISTICS = ("SampleCount", "Average", "Sum", "Minimum", "Maximum")
TREAT_MISSING = ("missing", "ignore", "breaching", "notBreaching")


@dataclass(frozen=True)
class Evaluation:
    state: str  # OK | ALARM | INSUFFICIENT_DATA
    reason: str
    values: tuple[float | None, ...]


def unsupported(alarm: Mapping[str, Any]) -> str | None:
    """Why this evaluator cannot evaluate the alarm, or None."""
    if alarm.get("Metrics"):
        return "metric math alarms are not evaluated locally"
    if alarm.get("Statistic") not in STATISTICS:
        return f"statistic {alarm.get('ExtendedStatistic') or alarm.get('Statistic')} is not evaluated locally"
    if alarm.get("ComparisonOperator") not in OPERATORS:
        return f"operator {alarm.get('ComparisonOperator')} is not evaluated locally"
    if alarm.get("TreatMissingData", "missing") not in TREAT_MISSING:
        return f"TreatMissingData {alarm.get('TreatMissingData')} is unknown"
    return None


def evaluate(alarm: Mapping[str, Any], values: Sequence[float | None]) -> Evaluation | None:
    """The state the alarm should be in given its statistic per period (oldest first, None = no data
    in that period); None when the state is to be kept (TreatMissingData `ignore`, no data at all).

    ALARM when at least DatapointsToAlarm (default EvaluationPeriods) of the last EvaluationPeriods
    periods breach the threshold, missing periods counting as TreatMissingData says."""
    periods = int(alarm["EvaluationPeriods"])
    needed = int(alarm.get("DatapointsToAlarm") or periods)
    treat = alarm.get("TreatMissingData") or "missing"
    compare, words = OPERATORS[alarm["ComparisonOperator"]]
    threshold = float(alarm["Threshold"])
    window = tuple([None] * (periods - len(values)) + list(values))[-periods:]
    present = [value for value in window if value is not None]
    breaching = sum(compare(value, threshold) for value in present)
    missing = len(window) - len(present)
    if treat == "breaching":
        breaching += missing
    shown = ", ".join("missing" if value is None else f"{value:g}" for value in window)
    if not present and treat in ("missing", "ignore") and breaching < needed:
        if treat == "ignore":
            return None
        return Evaluation("INSUFFICIENT_DATA", f"Insufficient Data: {periods} datapoints were unknown.", window)
    reason = (f"Threshold Crossed: {breaching} out of the last {periods} datapoints [{shown}] "
              f"{'was' if breaching == 1 else 'were'} {words} the threshold ({threshold:g}) "
              f"(minimum {needed} datapoint{'s' if needed > 1 else ''} for ALARM).")
    return Evaluation("ALARM" if breaching >= needed else "OK", reason, window)


def period_values(cloudwatch: Any, alarm: Mapping[str, Any], now: datetime) -> list[float | None]:
    """The alarm's statistic over each of its last EvaluationPeriods periods ending now, oldest first."""
    period = timedelta(seconds=int(alarm["Period"]))
    statistic = alarm["Statistic"]
    values: list[float | None] = []
    for back in range(int(alarm["EvaluationPeriods"]), 0, -1):
        start = now - back * period
        query: dict[str, Any] = {"Namespace": alarm["Namespace"], "MetricName": alarm["MetricName"],
                                 "Dimensions": alarm.get("Dimensions", []), "StartTime": start,
                                 "EndTime": start + period, "Period": int(alarm["Period"]),
                                 "Statistics": [statistic]}
        if alarm.get("Unit"):
            query["Unit"] = alarm["Unit"]
        points = cloudwatch.get_metric_statistics(**query)["Datapoints"]
        values.append(float(points[0][statistic]) if points else None)
    return values


class AlarmEvaluator:
    """Evaluates every metric alarm in (moto's) CloudWatch every `interval_seconds`, in a thread."""

    def __init__(self, region: str = "us-east-1", interval_seconds: float = 5.0,
                 session: boto3.session.Session | None = None, clock: Callable[[], datetime] | None = None):
        self._region = region
        self._session = session
        self._interval = interval_seconds
        self._clock = clock or (lambda: datetime.now(UTC))
        self._cloudwatch: Any = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._skipped: set[str] = set()  # alarms already logged as not evaluable

    def start(self) -> AlarmEvaluator:
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="alarm-evaluator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def evaluate_once(self) -> dict[str, str]:
        """One pass over every metric alarm; the alarms whose state it changed, with their new state."""
        cloudwatch = self._client()
        changed: dict[str, str] = {}
        now = self._clock()
        for alarm in self._metric_alarms(cloudwatch):
            why = unsupported(alarm)
            if why:
                if alarm["AlarmName"] not in self._skipped:
                    self._skipped.add(alarm["AlarmName"])
                    logger.info("alarm %s skipped: %s", alarm["AlarmName"], why)
                continue
            result = evaluate(alarm, period_values(cloudwatch, alarm, now))
            if result is None or result.state == alarm["StateValue"]:
                continue
            cloudwatch.set_alarm_state(AlarmName=alarm["AlarmName"], StateValue=result.state,
                                       StateReason=result.reason[:1023],
                                       StateReasonData=json.dumps({"version": "1.0", "recentDatapoints": [
                                           value for value in result.values if value is not None],
                                           "threshold": alarm["Threshold"], "evaluatedDatapoints": len(result.values),
                                           "localEvaluator": True}))
            changed[alarm["AlarmName"]] = result.state
            logger.info("alarm %s: %s -> %s", alarm["AlarmName"], alarm["StateValue"], result.state)
        return changed

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.evaluate_once()
            except Exception:  # moto restarting or gone: try again next round
                logger.warning("alarm evaluation failed", exc_info=True)

    def _client(self) -> Any:
        if self._cloudwatch is None:  # made on first use: AWS_ENDPOINT_URL is set after construction
            session = self._session or boto3.session.Session(region_name=self._region)
            self._cloudwatch = session.client("cloudwatch", region_name=self._region)
        return self._cloudwatch

    @staticmethod
    def _metric_alarms(cloudwatch: Any) -> list[dict[str, Any]]:
        alarms: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = cloudwatch.describe_alarms(**({"NextToken": token} if token else {}))
            alarms.extend(page.get("MetricAlarms", []))
            token = page.get("NextToken")
            if not token:
                return alarms
