"""PackFunction: a batch of accepted samples (PackQueue) -> one WebDataset shard + "Shard Sealed".

A shard is a batch-level effect, so records are parsed one by one (a malformed one alone fails)
and the valid ones are packed together; if packing fails, they all return to the queue.
"""

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.pack import pack_samples
from core.queue_batch import parse_batch
from core.models import Sample
from core.settings import PackSettings

logger = Logger()


@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    batch = parse_batch(event, Sample)
    result = pack_samples(batch.messages, PackSettings.from_env())
    logger.info("batch packed", extra={"shard": result.sealed and result.sealed.shard_id,
                                       "skipped": result.skipped, "invalid": len(batch.failures)})
    return batch.response()
