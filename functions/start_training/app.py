"""StartTrainingFunction: "Shard Sealed" events -> at the quota, one SageMaker training job."""

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.data_classes import EventBridgeEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.models import ShardSealed
from core.settings import TrainingSettings
from core.training import on_shard_sealed

logger = Logger()


# The envelope is read leniently (moto's EventBridge leaves out `account`); the detail strictly.
@logger.inject_lambda_context
@event_source(data_class=EventBridgeEvent)
def lambda_handler(event: EventBridgeEvent, context: LambdaContext) -> dict:
    shard = ShardSealed.model_validate(event.detail)
    decision = on_shard_sealed(shard, TrainingSettings.from_env())
    logger.info("shard counted", extra={"shard": shard.shard_id, "action": decision.action,
                                        "job": decision.job_name, "pending": decision.pending})
    return {"action": decision.action, "job": decision.job_name}
