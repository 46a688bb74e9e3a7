"""Training jobs in the API: CreateTrainingJob, Describe, List, Stop; each job's state and its events.

A job goes InProgress (Starting, Downloading, Training, Uploading) and ends Completed, Failed or
Stopped; every status change is an EventBridge "SageMaker Training Job State Change" event whose
detail mirrors DescribeTrainingJob. Each job runs in its own thread (training_run.py), which moves
it through those states with `advance`; a stop request or the stack's shutdown overtakes it with
`begin_stop`.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from atelier.local.sagemaker.aws_clients import AwsClients
from atelier.local.sagemaker.containers import log_tail
from atelier.local.sagemaker.documents import convert_times, epoch_millis, utc_now, write_state
from atelier.local.sagemaker.settings import Settings
from atelier.local.sagemaker.tags import ResourceTags, checked_tags
from atelier.local.sagemaker.training_instances import Instance, LossTrigger, job_instances
from atelier.local.sagemaker.training_requests import normalise_request
from atelier.local.sagemaker.training_run import JobRun
from atelier.local.sagemaker.validation import ApiError, listing, validation_error

logger = logging.getLogger(__name__)

EVENT_SOURCE = "aws.sagemaker"
EVENT_DETAIL_TYPE = "SageMaker Training Job State Change"
TERMINAL = frozenset({"Completed", "Failed", "Stopped"})
# Request members echoed by DescribeTrainingJob as given.
ECHOED = ("HyperParameters", "AlgorithmSpecification", "RoleArn", "InputDataConfig", "OutputDataConfig",
          "ResourceConfig", "VpcConfig", "StoppingCondition", "EnableNetworkIsolation",
          "EnableInterContainerTrafficEncryption", "EnableManagedSpotTraining", "CheckpointConfig",
          "Environment", "RetryStrategy", "ExperimentConfig", "DebugHookConfig", "TensorBoardOutputConfig")
# The StatusMessage SageMaker gives each secondary status.
STATUS_MESSAGES = {
    "Starting": "Preparing the instances for training",
    "Downloading": "Downloading input data",
    "Training": "Training image download completed. Training in progress.",
    "Uploading": "Uploading generated training model",
    "Completed": "Training job completed",
    "Failed": "Training job failed",
    "Stopping": "Stopping the training job",
    "Stopped": "Training job stopped",
    "MaxRuntimeExceeded": "Training job stopped: it exceeded MaxRuntimeInSeconds",
}


@dataclass
class TrainingJob:
    name: str
    arn: str
    request: dict[str, Any]
    root: Path
    creation_time: datetime = field(default_factory=utc_now)
    status: str = "InProgress"
    secondary: str = "Starting"
    start_time: datetime | None = None
    end_time: datetime | None = None
    last_modified: datetime | None = None
    failure_reason: str | None = None
    model_artifacts: str | None = None
    transitions: list[dict[str, Any]] = field(default_factory=list)
    stop_cause: str | None = None  # "Stopped" | "MaxRuntimeExceeded"
    stop_requested: threading.Event = field(default_factory=threading.Event)
    lost_host: str | None = None  # an instance loss asked for by lose_instance(), not yet acted on
    loss_trigger: LossTrigger = field(default_factory=LossTrigger)  # lose_instance(..., once=...)
    # Held across a change and its event so events leave in the order the changes happened.
    publish_lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    @property
    def instances(self) -> list[Instance]:
        return job_instances(self.root, self.request["ResourceConfig"]["InstanceCount"])

    def describe(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "TrainingJobName": self.name, "TrainingJobArn": self.arn,
            "TrainingJobStatus": self.status, "SecondaryStatus": self.secondary,
            **{key: self.request[key] for key in ECHOED if key in self.request},
            "CreationTime": self.creation_time, "LastModifiedTime": self.last_modified or self.creation_time,
            "SecondaryStatusTransitions": [dict(t) for t in self.transitions],
        }
        optional = {"FailureReason": self.failure_reason, "TrainingStartTime": self.start_time,
                    "TrainingEndTime": self.end_time}
        document.update({key: value for key, value in optional.items() if value is not None})
        if self.model_artifacts:
            document["ModelArtifacts"] = {"S3ModelArtifacts": self.model_artifacts}
        if self.start_time and self.end_time:
            seconds = int((self.end_time - self.start_time).total_seconds())
            document["TrainingTimeInSeconds"] = document["BillableTimeInSeconds"] = seconds
        return document

    def summary(self) -> dict[str, Any]:
        document = self.describe()
        keys = ("TrainingJobName", "TrainingJobArn", "CreationTime", "TrainingEndTime", "LastModifiedTime",
                "TrainingJobStatus", "SecondaryStatus")
        return {key: document[key] for key in keys if key in document}


class TrainingJobs:
    """The training-job half of the SageMaker API, and the runner behind it."""

    def __init__(self, settings: Settings, clients: AwsClients, tags: ResourceTags):
        self.settings = settings
        self.clients = clients
        self._tags = tags
        self._jobs: dict[str, TrainingJob] = {}
        self.lock = threading.RLock()  # guards every job's fields against the API threads
        self._closing = False
        self._close_grace = settings.stop_grace_seconds

    # --- API -------------------------------------------------------------------------------------

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        name = request["TrainingJobName"]
        normalised = normalise_request(request)
        tags = checked_tags(request.get("Tags"))
        arn = self.settings.arn("training-job", name)
        with self.lock:
            if self._closing:
                raise ApiError("ServiceUnavailable", "The local SageMaker is shutting down", 503)
            if name in self._jobs:  # API reference, CreateTrainingJob: unique in a Region of an account
                raise ApiError("ResourceInUse", "Training job names must be unique within an AWS account and "
                               f"region, and a training job with this name already exists ({arn})")
            root = self.settings.state_dir / "jobs" / name
            job = TrainingJob(name, arn, normalised, root)
            job.transitions.append(transition("Starting", job.creation_time))
            self._jobs[name] = job
            self._tags.created(arn, tags)
            job.thread = threading.Thread(target=JobRun(self, job), name=f"training-job-{name}", daemon=True)
        shutil.rmtree(root, ignore_errors=True)  # left by an earlier run of the stack; outside the lock: may be big
        self._persist(job.describe(), job)
        job.thread.start()
        return {"TrainingJobArn": arn}

    def describe(self, request: dict[str, Any]) -> dict[str, Any]:
        job = self._get(request["TrainingJobName"])
        with self.lock:
            return job.describe()

    def list_jobs(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            summaries = [job.summary() for job in self._jobs.values()]
        return listing(summaries, request, "TrainingJob", "TrainingJobSummaries", "Ascending")

    def stop(self, request: dict[str, Any]) -> dict[str, Any]:
        job = self._get(request["TrainingJobName"])
        with self.lock:
            status = job.status
        if status in TERMINAL:  # AWS's answer for a job that has ended
            raise validation_error(f"The request was rejected because the training job is in status {status}.")
        self.begin_stop(job, "Stopped")
        return {}

    def close(self, grace_seconds: float) -> None:
        """Stop every running job (as StopTrainingJob would, with a shorter grace) and wait for its
        runner to finish."""
        with self.lock:
            self._closing = True
            self._close_grace = min(grace_seconds, self.settings.stop_grace_seconds)
            running = [(job, job.thread) for job in self._jobs.values() if job.thread and job.thread.is_alive()]
        for job, _ in running:
            self.begin_stop(job, "Stopped")
        for _, thread in running:
            thread.join(timeout=grace_seconds + 60)

    # --- what the runner uses ----------------------------------------------------------------------

    def stop_grace(self) -> float:
        return self._close_grace

    def lose_instance(self, name: str, host: str = "algo-1", once: Callable[[], bool] | None = None) -> None:
        """Emulate losing one instance of a running job (a hardware fault): its container is killed
        at once, with no last checkpoint sync, the others are stopped, and the attempt fails as an
        InternalServerError that RetryStrategy retries. Acts on the attempt's running containers
        (or on the next ones to start); ValueError when the job is not InProgress. With `once`, at
        the first moment once() holds after a checkpoint upload instead (training_instances.LossTrigger)."""
        job = self._get(name)
        with self.lock:
            if job.status != "InProgress":
                raise ValueError(f"training job {name} is {job.status}: it has no instance to lose")
            if host not in [instance.host for instance in job.instances]:
                raise ValueError(f"training job {name} has no instance {host}")
            if once is None:
                job.lost_host = host
            else:
                job.loss_trigger.arm(host, once)

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The end of a job's container logs (<state>/jobs/<name>/algo-<k>/logs.txt), each headed by
        its host when the job has several instances."""
        instances = self._get(name).instances
        if len(instances) == 1:
            return log_tail(instances[0].log_path, lines)
        return "\n".join(f"==> {i.host} <==\n{log_tail(i.log_path, lines)}" for i in instances)

    def begin_stop(self, job: TrainingJob, cause: str) -> None:
        """Move an InProgress job to Stopping and tell its runner; a no-op once it is stopping."""
        with job.publish_lock:
            with self.lock:
                if job.status != "InProgress":
                    return
                job.stop_cause = cause
                self._change(job, "Stopping", "Stopping")
                snapshot = job.describe()
            job.stop_requested.set()
            self._publish(job, snapshot)

    def advance(self, job: TrainingJob, status: str, secondary: str, message: str | None = None,
                **fields: Any) -> bool:
        """Record a status change and put its event; False when the job has moved past it already
        (a stop request overtook the runner)."""
        with job.publish_lock:
            with self.lock:
                if job.status in TERMINAL or (job.status == "Stopping" and status == "InProgress"):
                    return False
                self._change(job, status, secondary, message)
                for name, value in fields.items():
                    setattr(job, name, value)
                snapshot = job.describe()
            self._publish(job, snapshot)
        return True

    def announce(self, job: TrainingJob) -> None:
        """Put the event for the state a job was created in."""
        with job.publish_lock:
            with self.lock:
                snapshot = job.describe()
            self._emit(job, snapshot)

    # --- internals ---------------------------------------------------------------------------------

    def _get(self, name: str) -> TrainingJob:
        with self.lock:
            job = self._jobs.get(name)
        if job is None:
            # What SageMaker answers for an unknown job (not ResourceNotFound, despite the model).
            raise validation_error("Requested resource not found.")
        return job

    def _change(self, job: TrainingJob, status: str, secondary: str, message: str | None = None) -> None:
        now = utc_now()
        if job.transitions:
            job.transitions[-1]["EndTime"] = now
        job.transitions.append(transition(secondary, now, message))
        if status in TERMINAL:
            job.transitions[-1]["EndTime"] = now
            job.end_time = now
        job.status, job.secondary, job.last_modified = status, secondary, now

    def _publish(self, job: TrainingJob, snapshot: dict[str, Any]) -> None:
        self._persist(snapshot, job)
        self._emit(job, snapshot)

    def _persist(self, snapshot: dict[str, Any], job: TrainingJob) -> None:
        write_state(job.root / "job.json", snapshot)

    def _emit(self, job: TrainingJob, snapshot: dict[str, Any]) -> None:
        """Put the state-change event; a lost event is logged, never fatal to the job (EventBridge
        delivery is best effort in AWS too)."""
        detail = convert_times({**snapshot, "Tags": self._tags.of(job.arn)}, epoch_millis)
        entry = {"Source": EVENT_SOURCE, "DetailType": EVENT_DETAIL_TYPE, "Resources": [job.arn],
                 "Detail": json.dumps(detail)}
        try:
            response = self.clients.get("events").put_events(Entries=[entry])
            if response.get("FailedEntryCount"):
                logger.warning("event for %s not accepted: %s", job.name, response["Entries"])
        except Exception:  # a down event bus must not break the job
            logger.warning("could not put the %s event for %s", snapshot["TrainingJobStatus"], job.name,
                           exc_info=True)


def transition(status: str, start: datetime, message: str | None = None) -> dict[str, Any]:
    return {"Status": status, "StartTime": start, "StatusMessage": message or STATUS_MESSAGES.get(status, status)}
