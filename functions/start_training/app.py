"""StartTrainingFunction: "Shard Sealed" events -> at the quota, one SageMaker training job."""

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.models import ShardSealed
from core.settings import TrainingSettings
from core.training import on_shard_sealed

logger = Logger()


class ShardSealedEvent(EventBridgeModel):
    detail: ShardSealed


@logger.inject_lambda_context
@event_parser(model=ShardSealedEvent)
def lambda_handler(event: ShardSealedEvent, context: LambdaContext) -> dict:
    decision = on_shard_sealed(event.detail, TrainingSettings.from_env())
    logger.info("shard counted", extra={"shard": event.detail.shard_id, "action": decision.action,
                                        "job": decision.job_name, "pending": decision.pending})
    return {"action": decision.action, "job": decision.job_name}
