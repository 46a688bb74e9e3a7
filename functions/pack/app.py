"""PackFunction: samples from PackQueue -> segments of the open shard; the schedule seals old shards.

An SQS batch: each valid sample is appended to a shard exactly once (docs/pack.md); a malformed
record, or one whose image cannot be read, alone goes back to the queue. If packing fails, every
record returns and the redelivery finishes what was started. The `rate(1 minute)` schedule seals
shards that would pass their maximum age before its next tick, and finishes seals that an invocation
left half done.
"""

import dataclasses

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.typing import LambdaContext

from contracts.messages import Sample
from core.pack.packer import SEAL_TIMER_S, pack_samples, seal_due
from core.queue_batch import parse_batch
from core.pack.settings import PackSettings

logger = Logger()
metrics = Metrics()  # core.pack.packer and core.pack.seal add to its buffer (core.telemetry)
tracer = Tracer()  # multipart parts, transactions, the seal's compose and event (docs/architecture.md)


@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    # A seal this invocation starts is leased to it until Lambda would stop it (core.pack.journal.claim_seal).
    settings = dataclasses.replace(PackSettings.from_env(), seal_lease_s=context.get_remaining_time_in_millis() / 1000)
    if event.get("source") == "aws.events":
        return {"sealed": [s.shard_id for s in seal_due(settings, ahead_s=SEAL_TIMER_S)]}
    batch = parse_batch(event, Sample)
    report = pack_samples(batch.messages, settings)
    logger.info("batch packed", extra={"committed": report.committed, "already_packed": report.already_packed,
                                       "sealed": [s.shard_id for s in report.sealed], "invalid": len(batch.failures)})
    return batch.response(report.failed)
