"""RedriveFunction: on a schedule, send transient dead letters back with backoff and a cap; hold
poison ones in their DLQs with their last error (core.redrive.dead_letters judges, core.redrive.redriver acts).
"""

import math

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.utilities.typing import LambdaContext

from core.redrive.redriver import redrive_all
from core.redrive.settings import RedriveSettings

logger = Logger()
metrics = Metrics()  # core.redrive.redriver adds DeadLettersRedriven, PoisonMessages, ScheduleTicksDropped
tracer = Tracer()


@tracer.capture_lambda_handler
@metrics.log_metrics
@logger.inject_lambda_context
def lambda_handler(event: dict, context: LambdaContext) -> dict:
    # A received message is hidden for what is left of this invocation (it cannot act on it later);
    # the last fifth is kept for acting on the batch in hand and releasing the held ones.
    hold_s = max(1, math.ceil(context.get_remaining_time_in_millis() / 1000))
    report = redrive_all(RedriveSettings.from_env(), hold_s,
                         lambda: context.get_remaining_time_in_millis() / 1000 - hold_s / 5)
    return {"redriven": dict(report.redriven), "waiting": dict(report.waiting), "dropped": dict(report.dropped),
            "poison": dict(report.poison)}
