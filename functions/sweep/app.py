"""SweepFunction: on a schedule, re-drive uploads that have no ingest record after a grace period.

A lost S3 notification delays a sample by at most one grace period plus one schedule period;
it never drops it (core.sweep).
"""

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.sweep.sweeper import sweep
from core.sweep.settings import SweepSettings

logger = Logger()
metrics = Metrics()  # core.sweep adds UploadsRedriven and SweepsDeferred to its buffer (core.telemetry)
tracer = Tracer()  # pages of ListObjects, batched record reads, re-drives (docs/architecture.md)


@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    report = sweep(SweepSettings.from_env())
    if report.deferred_depth:
        return {"listed": 0, "redriven": [], "deferred_queue_depth": report.deferred_depth}
    return {"listed": report.listed, "redriven": list(report.redriven)}
