"""ImportFunction: one ImportQueue message per existing WebDataset tar -> its valid, new samples
as one pipeline shard, sealed and announced like a packed one (docs/import.md).

Bad samples are quarantined and duplicates left out (successful outcomes); a malformed message or
an unexpected error fails its record alone, which retries (idempotently) and ends in ImportDLQ.
"""

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import ValidationError

from core import telemetry
from core.errors import BadMessage
from contracts.messages import ImportShard
from core.import_shard.importer import import_shard
from core.import_shard.settings import ImportSettings

logger = Logger()
metrics = Metrics()  # core.import_shard.importer adds the Import* metrics to its buffer (core.telemetry)
tracer = Tracer()  # the S3 stream and the per-sample DynamoDB calls of a tar (docs/architecture.md)
processor = BatchProcessor(event_type=EventType.SQS)


@tracer.capture_method
def record_handler(record: SQSRecord) -> None:
    try:
        message = ImportShard.model_validate_json(record.body)
    except ValidationError as exc:
        raise BadMessage(f"not an import message: {exc}") from exc
    with telemetry.correlated(message.uri):  # the tar's URI follows its samples' log lines
        report = import_shard(message, ImportSettings.from_env())
        logger.info("import message handled", extra={"source": report.source, "status": report.status,
                                                      "shard": report.shard_id, "accepted": report.accepted})


@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
