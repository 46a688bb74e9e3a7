"""DeployFunction: training jobs, evaluation jobs, model artefacts and endpoint state changes ->
the evaluation gate and a safe endpoint rollout (core.deploy; docs/deploy.md)."""

from dataclasses import asdict

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.data_classes import EventBridgeEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.deploy.candidates import on_artefact_published, on_job_state, reevaluate
from core.deploy.events import EVALUATE_REQUEST, ROLLBACK_REQUEST, DeployResult, job_state_from_event
from core.deploy.rollout import on_endpoint_state, on_rollback_request
from core.errors import BadMessage
from core.deploy.settings import DeploySettings

logger = Logger()
metrics = Metrics()
tracer = Tracer()  # each SageMaker and S3 call of the rollout as a subsegment (docs/architecture.md)


@tracer.capture_method
def route(event: EventBridgeEvent, settings: DeploySettings) -> DeployResult:
    """Each rule's events to their step; anything else is a configuration error."""
    if event.detail_type == "SageMaker Training Job State Change":
        return on_job_state(job_state_from_event(event.detail), settings)
    if event.detail_type in {"SageMaker Endpoint State Change", "SageMaker Endpoint Deployment State Change"}:
        return on_endpoint_state(str(event.detail.get("EndpointName", "")), settings)
    if event.detail_type == "Object Created":
        return on_artefact_published(event.detail["bucket"]["name"], event.detail["object"]["key"], settings)
    if event.detail_type == EVALUATE_REQUEST:
        return reevaluate(str(event.detail.get("model", "")), settings)
    if event.detail_type == ROLLBACK_REQUEST:
        return on_rollback_request(event.detail, settings)
    raise BadMessage(f"no deploy step for {event.source} / {event.detail_type}")


# Log lines are correlated by the training job, the endpoint, the artefact or the model the event is about.
CORRELATION = "detail.TrainingJobName || detail.EndpointName || detail.object.key || detail.model || detail.request_id"


@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context(correlation_id_path=CORRELATION)
@event_source(data_class=EventBridgeEvent)
def lambda_handler(event: EventBridgeEvent, context: LambdaContext) -> dict:
    return asdict(route(event, DeploySettings.current()))  # action, model, reason
