"""IngestFunction: S3 notifications (via UploadsQueue) -> licensed, described samples -> PackQueue.

A bad upload is quarantined with a reason (a successful outcome); only an unexpected error
fails its record, which then retries and ends in the DLQ.
"""

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.ingest.admission import ingest_notification
from core.ingest.settings import IngestSettings

logger = Logger()
metrics = Metrics()
processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    for outcome in ingest_notification(record.body, IngestSettings.from_env()):  # metrics: core.telemetry
        logger.info("upload handled", extra={"key": outcome.key, "status": outcome.status, "reason": outcome.reason,
                                             "correlation_id": outcome.key})


@metrics.log_metrics
@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
