"""DeployFunction: SageMaker training job state changes -> recorded; Completed -> endpoint."""

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.data_classes import EventBridgeEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.deploy import job_state_from_event, on_job_state
from core.settings import DeploySettings

logger = Logger()


@logger.inject_lambda_context
@event_source(data_class=EventBridgeEvent)
def lambda_handler(event: EventBridgeEvent, context: LambdaContext) -> dict:
    result = on_job_state(job_state_from_event(event.detail), DeploySettings.from_env())
    return {"action": result.action, "endpoint_config": result.endpoint_config}
