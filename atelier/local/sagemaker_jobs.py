"""Training jobs as SageMaker runs them: one background thread per job, one container per instance.

A job goes InProgress (Starting, Downloading, Training, Uploading) and ends Completed, Failed or
Stopped; every status change is an EventBridge "SageMaker Training Job State Change" event whose
detail mirrors DescribeTrainingJob. Each of the job's InstanceCount instances (algo-1..algo-N) runs
the container once per attempt over its own /opt/ml (ATELIER_OPT_ML), with its share of the
channels and its checkpoint dir mirrored to S3 (sagemaker_instances.py). An attempt that loses an
instance fails as an InternalServerError and, within RetryStrategy.MaximumRetryAttempts, the job
starts over on new instances that restore the checkpoints; a container's own failure is not retried.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from atelier.local.sagemaker_common import (
    ApiError,
    AwsClients,
    ContainerProcess,
    S3Uri,
    Settings,
    check_name,
    check_volume_key,
    container_env,
    convert_times,
    epoch_millis,
    free_port,
    log_tail,
    page,
    require,
    upload,
    utc_now,
    validation_error,
    write_state,
)
from atelier.local.sagemaker_instances import (
    CONTAINER_CHECKPOINTS,
    CONTAINER_TENSORBOARD,
    CheckpointSync,
    Instance,
    JobFailure,
    archive,
    has_files,
    job_instances,
    materialise_channels,
    write_layout,
)
from atelier.local.sagemaker_tags import ResourceTags, checked_tags

logger = logging.getLogger(__name__)

EVENT_SOURCE = "aws.sagemaker"
EVENT_DETAIL_TYPE = "SageMaker Training Job State Change"
TERMINAL = frozenset({"Completed", "Failed", "Stopped"})
MAX_FAILURE_REASON = 1024
DEFAULT_MAX_RUNTIME = 86400  # SageMaker's default: one day
# What SageMaker reports for a failure of its own (the class RetryStrategy retries).
INTERNAL_ERROR = "InternalServerError: We encountered an internal error. Please try again."
# Every emulated instance is this machine: the containers' rendezvous address (trainer/container.py).
LOOPBACK = "127.0.0.1"
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


class InstanceLost(Exception):
    """An attempt lost an instance: SageMaker's own failure, retried under RetryStrategy."""


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
        self._settings = settings
        self._clients = clients
        self._tags = tags
        self._jobs: dict[str, TrainingJob] = {}
        self._lock = threading.RLock()
        self._closing = False
        self._close_grace = settings.stop_grace_seconds

    # --- API -------------------------------------------------------------------------------------

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(require(request, "TrainingJobName"), "trainingJobName")
        normalised = normalise_request(request)
        tags = checked_tags(request.get("Tags"))
        arn = self._settings.arn("training-job", name)
        with self._lock:
            if self._closing:
                raise ApiError("ServiceUnavailable", "The local SageMaker is shutting down", 503)
            if name in self._jobs:
                raise ApiError("ResourceInUse", "Training job names must be unique within an AWS account and "
                               f"region, and a training job with this name already exists ({arn})")
            root = self._settings.state_dir / "jobs" / name
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
        job = self._get(require(request, "TrainingJobName"))
        with self._lock:
            return job.describe()

    def list_jobs(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            summaries = [job.summary() for job in self._jobs.values()]
        if request.get("NameContains"):
            summaries = [s for s in summaries if request["NameContains"] in s["TrainingJobName"]]
        if request.get("StatusEquals"):
            summaries = [s for s in summaries if s["TrainingJobStatus"] == request["StatusEquals"]]
        sort_key = {"Name": "TrainingJobName", "Status": "TrainingJobStatus"}.get(
            request.get("SortBy", "CreationTime"), "CreationTime")
        summaries.sort(key=lambda s: s[sort_key], reverse=request.get("SortOrder") == "Descending")
        items, token = page(summaries, request)
        return {"TrainingJobSummaries": items, **({"NextToken": token} if token else {})}

    def stop(self, request: dict[str, Any]) -> dict[str, Any]:
        job = self._get(require(request, "TrainingJobName"))
        with self._lock:
            status = job.status
        if status in TERMINAL:
            raise validation_error(f"The request was rejected because the training job is in status {status}.")
        self.begin_stop(job, "Stopped")
        return {}

    def close(self, grace_seconds: float) -> None:
        """Stop every running job (as StopTrainingJob would, with a shorter grace) and wait for its
        runner to finish."""
        with self._lock:
            self._closing = True
            self._close_grace = min(grace_seconds, self._settings.stop_grace_seconds)
            running = [(job, job.thread) for job in self._jobs.values() if job.thread and job.thread.is_alive()]
        for job, _ in running:
            self.begin_stop(job, "Stopped")
        for _, thread in running:
            thread.join(timeout=grace_seconds + 60)

    # --- what the runner uses ----------------------------------------------------------------------

    def stop_grace(self) -> float:
        return self._close_grace

    def lose_instance(self, name: str, host: str = "algo-1") -> None:
        """Emulate losing one instance of a running job (a hardware fault): its container is killed
        at once, with no last checkpoint sync, the others are stopped, and the attempt fails as an
        InternalServerError that RetryStrategy retries. Acts on the attempt's running containers
        (or on the next ones to start); ValueError when the job is not InProgress."""
        job = self._get(name)
        with self._lock:
            if job.status != "InProgress":
                raise ValueError(f"training job {name} is {job.status}: it has no instance to lose")
            if host not in [instance.host for instance in job.instances]:
                raise ValueError(f"training job {name} has no instance {host}")
            job.lost_host = host

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The end of a job's container logs (<state>/jobs/<name>/algo-<k>/logs.txt), each headed by
        its host when the job has several instances."""
        instances = self._get(name).instances
        if len(instances) == 1:
            return log_tail(instances[0].log_path, lines)
        return "\n".join(f"==> {i.host} <==\n{log_tail(i.log_path, lines)}" for i in instances)

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def clients(self) -> AwsClients:
        return self._clients

    @property
    def lock(self) -> threading.RLock:
        """Guards every job's fields against the API threads."""
        return self._lock

    def begin_stop(self, job: TrainingJob, cause: str) -> None:
        """Move an InProgress job to Stopping and tell its runner; a no-op once it is stopping."""
        with job.publish_lock:
            with self._lock:
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
            with self._lock:
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
            with self._lock:
                snapshot = job.describe()
            self._emit(job, snapshot)

    # --- internals ---------------------------------------------------------------------------------

    def _get(self, name: str) -> TrainingJob:
        with self._lock:
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
            response = self._clients.get("events").put_events(Entries=[entry])
            if response.get("FailedEntryCount"):
                logger.warning("event for %s not accepted: %s", job.name, response["Entries"])
        except Exception:  # a down event bus must not break the job
            logger.warning("could not put the %s event for %s", snapshot["TrainingJobStatus"], job.name,
                           exc_info=True)


@dataclass
class Exit:
    """How an attempt's containers ended: all 0, one failed, stopped, or an instance lost."""

    failed: tuple[Instance, int] | None = None
    lost: Instance | None = None


class JobRun:
    """Runs one job from Starting to its end, attempt after attempt, in its own thread."""

    def __init__(self, jobs: TrainingJobs, job: TrainingJob):
        self._jobs = jobs
        self._job = job
        self._s3 = None

    def __call__(self) -> None:
        try:
            self._run()
        except JobFailure as failure:
            self._fail(str(failure))
        except Exception as error:  # the runner broke: SageMaker's own error class (not retried here)
            logger.exception("local runner failed on %s", self._job.name)
            self._fail(f"InternalServerError: local runner: {error}")

    def _run(self) -> None:
        job, jobs = self._job, self._jobs
        jobs.announce(job)
        self._s3 = jobs.clients.get("s3")
        check_supported(job.request)
        attempts = 1 + (job.request.get("RetryStrategy") or {}).get("MaximumRetryAttempts", 0)
        attempt = 1
        while True:
            try:
                return self._attempt(attempt, attempts)
            except InstanceLost as lost:
                if attempt == attempts:
                    raise JobFailure(f"{INTERNAL_ERROR} (local runner: {lost})") from None
            attempt += 1
            # As RetryStrategy documents: a retried job's SecondaryStatus goes back to Starting.
            if not jobs.advance(job, "InProgress", "Starting", f"Restarting the training job after an internal "
                                f"error: attempt {attempt} of {attempts} on new instances"):
                return self._finish_stopped()

    def _attempt(self, attempt: int, attempts: int) -> None:
        """One run on fresh instances: layout, checkpoints and channels, containers, outputs."""
        job, jobs = self._job, self._jobs
        for instance in job.instances:
            write_layout(instance, job.request)
        first = {"start_time": utc_now()} if attempt == 1 else {}
        if not jobs.advance(job, "InProgress", "Downloading", **first):
            return self._finish_stopped()
        syncs = self._checkpoint_syncs()
        for sync in syncs.values():
            sync.restore()
        materialise_channels(self._s3, job.request.get("InputDataConfig", []), job.instances)
        if not jobs.advance(job, "InProgress", "Training"):
            return self._finish_stopped()
        end = self._train(syncs, f"attempt {attempt} of {attempts}")
        if end.lost:
            raise InstanceLost(f"instance {end.lost.host} was lost during attempt {attempt} of {attempts}")
        if job.stop_cause:
            return self._finish_stopped()
        if end.failed:
            raise JobFailure(failure_reason(*end.failed))
        if not jobs.advance(job, "InProgress", "Uploading"):
            return self._finish_stopped()
        artifacts = self._upload_outputs()
        jobs.advance(job, "Completed", "Completed", model_artifacts=artifacts)

    def _checkpoint_syncs(self) -> dict[str, CheckpointSync]:
        """One sync per instance, all to the same S3Uri (none without CheckpointConfig)."""
        config = self._job.request.get("CheckpointConfig")
        if not config:
            return {}
        remote = S3Uri.parse(config["S3Uri"])
        return {i.host: CheckpointSync(self._s3, i.checkpoint_dir(self._job.request), remote,
                                       self._jobs.settings.checkpoint_sync_seconds) for i in self._job.instances}

    def _train(self, syncs: dict[str, CheckpointSync], attempt: str) -> Exit:
        """Run one container per instance until they end, one fails, the job is stopped or outruns
        MaxRuntimeInSeconds, or an instance is lost."""
        job, settings = self._job, self._jobs.settings
        argv = settings.command(job.request["AlgorithmSpecification"]["TrainingImage"], "train")
        port = str(free_port())  # the rendezvous of this attempt's hosts
        containers: dict[str, ContainerProcess] = {}
        try:
            for instance in job.instances:
                with open(instance.log_path, "a") as log:
                    log.write(f"--- {job.name} {attempt} on {instance.host} ---\n")
                env = container_env({"ATELIER_OPT_ML": str(instance.opt_ml), "TRAINING_JOB_NAME": job.name,
                                     "TRAINING_JOB_ARN": job.arn, "ATELIER_MASTER_ADDR": LOOPBACK,
                                     "ATELIER_MASTER_PORT": port}, job.request.get("Environment", {}))
                containers[instance.host] = ContainerProcess(argv, env, settings.cwd, instance.log_path)
        except OSError as error:
            for container in containers.values():
                container.kill()
            raise JobFailure(f"ClientError: cannot start the container {argv}: {error}") from error
        for sync in syncs.values():
            sync.start()
        end = Exit()
        try:
            end = self._supervise(containers)
        finally:
            stop_together(list(containers.values()), 0)  # nothing may outlive its attempt
            for host, sync in syncs.items():  # a last sync, also after a failure, but not from a lost instance
                sync.stop(final_sync=not (end.lost and end.lost.host == host))
            self._upload_tensorboard()
        return end

    def _upload_tensorboard(self) -> None:
        """TensorBoardOutputConfig: each instance's LocalPath files under S3OutputPath. SageMaker
        uploads them while the job runs; here at the end of each attempt, failed ones too."""
        config = self._job.request.get("TensorBoardOutputConfig")
        if not config:
            return
        remote = S3Uri.parse(config["S3OutputPath"])
        for instance in self._job.instances:
            folder = instance.tensorboard_dir(self._job.request)
            for path in sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []:
                upload(self._s3, path, remote.join(path.relative_to(folder).as_posix()))

    def _supervise(self, containers: dict[str, ContainerProcess]) -> Exit:
        job, instances = self._job, {i.host: i for i in self._job.instances}
        max_runtime = job.request["StoppingCondition"].get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
        deadline = (job.start_time or job.creation_time).timestamp() + max_runtime
        running = dict(containers)
        while running:
            if lost := self._take_lost_host():
                containers[lost].kill()  # the instance is gone: no grace, no last checkpoint sync
                stop_together([c for host, c in running.items() if host != lost], self._jobs.stop_grace())
                return Exit(lost=instances[lost])
            for host, container in list(running.items()):
                if (code := container.poll()) is None:
                    continue
                container.reap_group()
                del running[host]
                if code != 0:  # one algorithm container failing ends the attempt
                    stop_together(list(running.values()), self._jobs.stop_grace())
                    return Exit(failed=(instances[host], code))
            if time.time() >= deadline:
                self._jobs.begin_stop(job, "MaxRuntimeExceeded")
            if job.stop_requested.wait(0.1):
                stop_together(list(running.values()), self._jobs.stop_grace())
                return Exit()
        return Exit()

    def _take_lost_host(self) -> str | None:
        with self._jobs.lock:
            host, self._job.lost_host = self._job.lost_host, None
        return host

    def _upload_outputs(self) -> str:
        """Every instance's model/ as one model.tar.gz (and output/data/ as output.tar.gz when any
        instance wrote there), as SageMaker gathers them."""
        job = self._job
        output = S3Uri.parse(job.request["OutputDataConfig"]["S3OutputPath"]).join(job.name, "output")
        data_dirs = [i.opt_ml / "output" / "data" for i in job.instances]
        if has_files(data_dirs):
            upload(self._s3, archive(data_dirs, job.root / "output.tar.gz"), output.join("output.tar.gz"))
        model = output.join("model.tar.gz")
        upload(self._s3, archive([i.opt_ml / "model" for i in job.instances], job.root / "model.tar.gz"), model)
        return str(model)

    def _finish_stopped(self) -> None:
        """Stopped: SageMaker still uploads what the containers saved in model/ during their grace."""
        job = self._job
        artifacts = None
        if has_files([i.opt_ml / "model" for i in job.instances]):
            try:
                artifacts = self._upload_outputs()
            except Exception:  # stopping must end Stopped even if S3 is gone
                logger.warning("could not upload the model of stopped job %s", job.name, exc_info=True)
        self._jobs.advance(job, "Stopped", job.stop_cause or "Stopped", model_artifacts=artifacts)

    def _fail(self, reason: str) -> None:
        if self._job.status == "Stopping":
            return self._finish_stopped()
        self._jobs.advance(self._job, "Failed", "Failed", failure_reason=reason[:MAX_FAILURE_REASON])


def stop_together(containers: list[ContainerProcess], grace: float) -> None:
    """SIGTERM every container, then SIGKILL those still running when the one grace period ends."""
    for container in containers:
        container.terminate()
    deadline = time.monotonic() + grace
    for container in containers:
        container.stop(max(0.0, deadline - time.monotonic()))


# --- requests ----------------------------------------------------------------------------------

def normalise_request(request: dict[str, Any]) -> dict[str, Any]:
    """Check what the local runner needs and fill the defaults DescribeTrainingJob shows."""
    for member in ("RoleArn", "AlgorithmSpecification.TrainingImage", "OutputDataConfig.S3OutputPath",
                   "ResourceConfig", "StoppingCondition"):
        require(request, member)
    S3Uri.parse(request["OutputDataConfig"]["S3OutputPath"], "S3OutputPath")
    check_volume_key(require(request, "ResourceConfig.InstanceType"), request["ResourceConfig"].get("VolumeKmsKeyId"),
                     "VolumeKmsKeyId")
    if request.get("CheckpointConfig"):
        S3Uri.parse(require(request, "CheckpointConfig.S3Uri"), "CheckpointConfig.S3Uri")
    if request.get("TensorBoardOutputConfig"):
        S3Uri.parse(require(request, "TensorBoardOutputConfig.S3OutputPath"), "TensorBoardOutputConfig.S3OutputPath")
    normalised = json.loads(json.dumps(request))  # a deep copy the caller cannot change
    normalised.setdefault("HyperParameters", {})
    normalised["ResourceConfig"].setdefault("InstanceCount", 1)
    check_range(normalised["ResourceConfig"]["InstanceCount"], "resourceConfig.instanceCount", 1)
    if normalised.get("RetryStrategy") is not None:
        check_range(require(normalised, "RetryStrategy.MaximumRetryAttempts"),
                    "retryStrategy.maximumRetryAttempts", 1, 30)
    normalised["StoppingCondition"].setdefault("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
    if normalised.get("CheckpointConfig"):
        normalised["CheckpointConfig"].setdefault("LocalPath", CONTAINER_CHECKPOINTS)
    if normalised.get("TensorBoardOutputConfig"):
        normalised["TensorBoardOutputConfig"].setdefault("LocalPath", CONTAINER_TENSORBOARD)
    names = [require(channel, "ChannelName") for channel in normalised.get("InputDataConfig", [])]
    if len(names) != len(set(names)):
        raise validation_error(f"Channel names must be unique: {names}")
    for channel in normalised.get("InputDataConfig", []):
        source = channel.get("DataSource", {}).get("S3DataSource")
        if source:
            source.setdefault("S3DataDistributionType", "FullyReplicated")
            S3Uri.parse(require(source, "S3Uri"), "S3DataSource.S3Uri")
    return normalised


def check_range(value: Any, member: str, low: int, high: int | None = None) -> None:
    """The ValidationException SageMaker gives an integer member out of its range."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise validation_error(f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy "
                               f"constraint: Member must have value greater than or equal to {low}")
    if high is not None and value > high:
        raise validation_error(f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy "
                               f"constraint: Member must have value less than or equal to {high}")


def check_supported(request: dict[str, Any]) -> None:
    """What this runner cannot do fails the job with a reason that says so."""
    for channel in request.get("InputDataConfig", []):
        source = channel.get("DataSource", {}).get("S3DataSource") or {}
        if source.get("S3DataType") not in ("S3Prefix", "ManifestFile"):
            raise JobFailure(f"ClientError: local runner supports S3DataSource with S3DataType S3Prefix or "
                             f"ManifestFile (channel {channel['ChannelName']})")


def failure_reason(instance: Instance, code: int) -> str:
    """The failed container's output/failure when it wrote one (SageMaker's contract), else its exit
    and log tail."""
    failure_file = instance.opt_ml / "output" / "failure"
    if failure_file.is_file():
        text = failure_file.read_text(errors="replace").strip()
        if text:
            return text[:MAX_FAILURE_REASON]
    how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
    return f"AlgorithmError: {how}. Log {instance.log_path} ends:\n{log_tail(instance.log_path, lines=12)}"


def transition(status: str, start: datetime, message: str | None = None) -> dict[str, Any]:
    return {"Status": status, "StartTime": start, "StatusMessage": message or STATUS_MESSAGES.get(status, status)}
