"""IngestFunction: S3 notifications (via UploadsQueue) -> metadata records -> PackQueue."""

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.ingest import ingest_notification
from core.settings import IngestSettings

logger = Logger()
processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    for outcome in ingest_notification(record.body, IngestSettings.from_env()):
        logger.info("upload handled", extra={"key": outcome.key, "status": outcome.status, "reason": outcome.reason})


@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
