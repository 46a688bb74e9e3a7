"""What the stages report to CloudWatch: EMF metrics and the correlation id of their log lines.

Metrics are Powertools EMF lines on stdout; CloudWatch turns them into metrics in the
`POWERTOOLS_METRICS_NAMESPACE` namespace (the template's `MetricsNamespace`), each with the
`service` dimension (`POWERTOOLS_SERVICE_NAME`). Powertools keeps one metric buffer per process
(class attributes), so the handler's `@metrics.log_metrics` flushes what the core added here. A
metric with its own dimension (`reason`) goes out at once in its own EMF line: a dimension added
to the shared buffer would label every other metric of the invocation too.

Without a namespace (tests or scripts that call the core directly) nothing is recorded.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.exceptions import OrphanedChildLoggerError
from aws_lambda_powertools.metrics import MetricUnit, single_metric

logger = Logger(child=True)
metrics = Metrics()

# The metric names (docs/runbook.md lists them; the dashboard and alarms in template.yaml read them).
UPLOADS_ACCEPTED = "UploadsAccepted"
UPLOADS_REJECTED = "UploadsRejected"  # dimension `reason` (contracts.pipeline_table.QUARANTINE_REASONS)
UPLOADS_DUPLICATE = "UploadsDuplicate"  # exact duplicates (also counted as rejected, reason duplicate)
UPLOADS_NEAR_DUPLICATE = "UploadsNearDuplicate"  # accepted, flagged near_duplicate_of
NEAR_DUPLICATE_KEYS_FULL = "NearDuplicateKeysFull"  # index keys that reached their cap (core.ingest.dedup)
SAMPLES_PACKED = "SamplesPacked"
SEGMENT_BYTES = "SegmentBytes"
UPLOAD_TO_SHARD_SECONDS = "UploadToShardSeconds"  # the upload's S3 time -> its segment committed to a shard
SHARDS_SEALED = "ShardsSealed"
SHARD_BYTES = "ShardBytes"
TRAINING_JOBS_STARTED = "TrainingJobsStarted"
LINEAGES_HALTED = "LineagesHalted"  # the circuit breaker opened (core.start_training.failure_brake): nothing starts until resumed
TRAINING_JOBS_FINISHED = {"Completed": "TrainingJobsCompleted", "Failed": "TrainingJobsFailed",
                          "Stopped": "TrainingJobsStopped"}
DEPLOYMENTS = "Deployments"  # endpoint created or updated (emitted by core.deploy.rollout)
MODELS_EVALUATED = "ModelsEvaluated"  # the gate decided (passed or held back)
MODELS_HELD_BACK = "ModelsHeldBack"  # the gate said no, or the evaluation failed
ROLLBACKS = "Rollbacks"  # by hand or by an alarm
IMPORTED_SHARDS = "ImportedShards"  # dimension `status`: imported | empty | rejected (core.import_shard.importer)
IMPORTED_SAMPLES = "ImportedSamples"  # accepted into a pipeline shard
IMPORT_DUPLICATES = "ImportDuplicates"  # exact duplicates, left out: already in the pipeline
IMPORT_NEAR_DUPLICATES = "ImportNearDuplicates"  # flagged or left out, as the import's --near-duplicates says
IMPORT_REJECTS = "ImportRejects"  # quarantined for any other reason
DEAD_LETTERS_REDRIVEN = "DeadLettersRedriven"  # sent back to their source by RedriveFunction (core.redrive.redriver)
POISON_MESSAGES = "PoisonMessages"  # held in their DLQs as poison, per run (a gauge: PoisonDeadLettersAlarm)
SCHEDULE_TICKS_DROPPED = "ScheduleTicksDropped"  # failed timer ticks removed (the next tick does their work)
UPLOADS_REDRIVEN = "UploadsRedriven"  # per sweep run: uploads with no record, sent again (core.sweep)
SWEEPS_DEFERRED = "SweepsDeferred"  # a sweep run skipped while ingest is behind (UploadsQueue over its limit)
REASON = "reason"


def enabled() -> bool:
    return bool(os.environ.get("POWERTOOLS_METRICS_NAMESPACE"))


def count(name: str, value: float = 1, unit: MetricUnit = MetricUnit.Count) -> None:
    """Add to the invocation's buffer (flushed by the handler's `@metrics.log_metrics`)."""
    if enabled():
        metrics.add_metric(name=name, unit=unit, value=value)


def count_by(name: str, dimension: str, value_of: str, value: float = 1) -> None:
    """One metric with its own dimension, written at once as its own EMF line."""
    if not enabled():
        return
    with single_metric(name=name, unit=MetricUnit.Count, value=value,
                       default_dimensions=metrics.default_dimensions) as metric:
        metric.add_dimension(name=dimension, value=value_of)


def seconds_since(iso_time: str, now: datetime | None = None) -> float | None:
    """Seconds from an ISO-8601 time (an S3 event time) to now; None if it cannot be read."""
    try:
        then = datetime.fromisoformat(iso_time.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return max(0.0, ((now or datetime.now(timezone.utc)) - then).total_seconds())


@contextmanager
def correlated(correlation_id: str, **keys: str) -> Iterator[None]:
    """Every log line inside carries `correlation_id` (and `keys`); the previous id comes back after."""
    try:
        previous = logger.get_correlation_id()
        logger.set_correlation_id(correlation_id)
    except OrphanedChildLoggerError:  # no service Logger() in this process (a script): nothing to label
        labelled = False
    else:
        labelled = True
    if not labelled:  # the body runs outside the handler: its errors do not read "during handling of ..."
        yield
        return
    try:
        with logger.append_context_keys(**keys):
            yield
    finally:
        logger.set_correlation_id(previous)
