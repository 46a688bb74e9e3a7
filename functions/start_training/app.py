"""StartTrainingFunction: "Shard Sealed" events count towards the quota; a training job's end
(Completed, Failed, Stopped) is recorded on its `JOB#` record, which this function alone writes the
status of (DeployFunction, on the same event, writes only `model_data`; docs/training-jobs.md), and
frees its lineage for the next stage or the next manifest; the schedule looks again at a lineage
whose failure backoff may have ended."""

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.data_classes import EventBridgeEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from contracts.messages import ShardSealed
from core import telemetry
from core.start_training.settings import TrainingSettings
from core.start_training.starter import RESUME_REQUEST, StartDecision, advance, on_job_finished, on_shard_sealed, resume

logger = Logger()
metrics = Metrics()
tracer = Tracer()  # the claim transaction, manifest writes, CreateTrainingJob (docs/architecture.md)


# The envelope is read leniently (moto's EventBridge leaves out `account`); the detail strictly.
# Log lines are correlated by the shard, or the training job, the event is about.
@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context(correlation_id_path="detail.shard_id || detail.TrainingJobName")
@event_source(data_class=EventBridgeEvent)
def lambda_handler(event: EventBridgeEvent, context: LambdaContext) -> dict:
    settings = TrainingSettings.current()  # the environment and the current recipe
    if event.source == "aws.sagemaker":
        detail = event.detail
        decision = on_job_finished(detail["TrainingJobName"], detail["TrainingJobStatus"],
                                   detail.get("FailureReason"), settings)
        if decision.action != "not-ours":  # evaluation jobs end here too
            telemetry.count(telemetry.TRAINING_JOBS_FINISHED[detail["TrainingJobStatus"]])  # the rule's three states
    elif event.detail_type == "Scheduled Event":
        decision = advance(settings)
    elif event.detail_type == RESUME_REQUEST:  # an operator resumed a halted lineage
        decision = resume(settings) if event.detail["lineage"] == settings.lineage else StartDecision("not-ours")
    else:
        decision = on_shard_sealed(ShardSealed.model_validate(event.detail), settings)
    if decision.action == "started":
        telemetry.count(telemetry.TRAINING_JOBS_STARTED)
    logger.info("training decision", extra={"action": decision.action, "job": decision.job_name,
                                            "pending": decision.pending})
    return {"action": decision.action, "job": decision.job_name}


__all__ = ["lambda_handler", "StartDecision"]
