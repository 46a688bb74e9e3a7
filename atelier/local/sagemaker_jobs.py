"""Training jobs as SageMaker runs them: one background thread and one container process per job.

A job goes InProgress (Starting, Downloading, Training, Uploading) and ends Completed, Failed or
Stopped; every status change is an EventBridge "SageMaker Training Job State Change" event whose
detail mirrors DescribeTrainingJob. The container sees the /opt/ml layout under its own directory
(ATELIER_OPT_ML), with channels materialised from S3 and checkpoints mirrored to S3.
"""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
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
    container_env,
    convert_times,
    download,
    download_prefix,
    epoch_millis,
    inside,
    log_tail,
    page,
    require,
    upload,
    utc_now,
    validation_error,
    write_state,
)

logger = logging.getLogger(__name__)

EVENT_SOURCE = "aws.sagemaker"
EVENT_DETAIL_TYPE = "SageMaker Training Job State Change"
TERMINAL = frozenset({"Completed", "Failed", "Stopped"})
MAX_FAILURE_REASON = 1024
DEFAULT_MAX_RUNTIME = 86400  # SageMaker's default: one day
CONTAINER_CHECKPOINTS = "/opt/ml/checkpoints"
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


class JobFailure(Exception):
    """Ends a job as Failed with this FailureReason."""


@dataclass
class TrainingJob:
    name: str
    arn: str
    request: dict[str, Any]
    root: Path
    tags: dict[str, str]
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
    # Held across a change and its event so events leave in the order the changes happened.
    publish_lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    @property
    def opt_ml(self) -> Path:
        return self.root / "opt_ml"

    @property
    def log_path(self) -> Path:
        return self.root / "logs.txt"

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

    def __init__(self, settings: Settings, clients: AwsClients):
        self._settings = settings
        self._clients = clients
        self._jobs: dict[str, TrainingJob] = {}
        self._lock = threading.RLock()
        self._closing = False
        self._close_grace = settings.stop_grace_seconds

    # --- API -------------------------------------------------------------------------------------

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        name = check_name(require(request, "TrainingJobName"), "trainingJobName")
        normalised = normalise_request(request)
        arn = self._settings.arn("training-job", name)
        with self._lock:
            if self._closing:
                raise ApiError("ServiceUnavailable", "The local SageMaker is shutting down", 503)
            if name in self._jobs:
                raise ApiError("ResourceInUse", "Training job names must be unique within an AWS account and "
                               f"region, and a training job with this name already exists ({arn})")
            root = self._settings.state_dir / "jobs" / name
            job = TrainingJob(name, arn, normalised, root, tags=tag_map(request.get("Tags")))
            job.transitions.append(transition("Starting", job.creation_time))
            self._jobs[name] = job
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

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The end of a job's container log (<state>/jobs/<name>/logs.txt)."""
        return log_tail(self._get(name).log_path, lines)

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def clients(self) -> AwsClients:
        return self._clients

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

    def advance(self, job: TrainingJob, status: str, secondary: str, **fields: Any) -> bool:
        """Record a status change and put its event; False when the job has moved past it already
        (a stop request overtook the runner)."""
        with job.publish_lock:
            with self._lock:
                if job.status in TERMINAL or (job.status == "Stopping" and status == "InProgress"):
                    return False
                self._change(job, status, secondary)
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

    def _change(self, job: TrainingJob, status: str, secondary: str) -> None:
        now = utc_now()
        if job.transitions:
            job.transitions[-1]["EndTime"] = now
        job.transitions.append(transition(secondary, now))
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
        detail = convert_times({**snapshot, "Tags": job.tags}, epoch_millis)
        entry = {"Source": EVENT_SOURCE, "DetailType": EVENT_DETAIL_TYPE, "Resources": [job.arn],
                 "Detail": json.dumps(detail)}
        try:
            response = self._clients.get("events").put_events(Entries=[entry])
            if response.get("FailedEntryCount"):
                logger.warning("event for %s not accepted: %s", job.name, response["Entries"])
        except Exception:  # a down event bus must not break the job
            logger.warning("could not put the %s event for %s", snapshot["TrainingJobStatus"], job.name,
                           exc_info=True)


class JobRun:
    """Runs one job from Starting to its end, in its own thread."""

    def __init__(self, jobs: TrainingJobs, job: TrainingJob):
        self._jobs = jobs
        self._job = job
        self._s3 = None

    def __call__(self) -> None:
        try:
            self._run()
        except JobFailure as failure:
            self._fail(str(failure))
        except Exception as error:  # the runner broke: SageMaker's own error class
            logger.exception("local runner failed on %s", self._job.name)
            self._fail(f"InternalServerError: local runner: {error}")

    def _run(self) -> None:
        job, jobs = self._job, self._jobs
        jobs.announce(job)
        self._s3 = jobs.clients.get("s3")
        check_supported(job.request)
        layout = write_layout(job)
        if not jobs.advance(job, "InProgress", "Downloading", start_time=utc_now()):
            return self._finish_stopped()
        checkpoints = self._checkpoint_sync()
        if checkpoints:
            checkpoints.restore()
        materialise_channels(self._s3, job.request.get("InputDataConfig", []), layout / "input" / "data")
        if not jobs.advance(job, "InProgress", "Training"):
            return self._finish_stopped()
        code = self._train(checkpoints)
        if job.stop_cause:
            return self._finish_stopped()
        if code != 0:
            raise JobFailure(failure_reason(job, code))
        if not jobs.advance(job, "InProgress", "Uploading"):
            return self._finish_stopped()
        artifacts = self._upload_outputs()
        jobs.advance(job, "Completed", "Completed", model_artifacts=artifacts)

    def _checkpoint_sync(self) -> CheckpointSync | None:
        config = self._job.request.get("CheckpointConfig")
        if not config:
            return None
        return CheckpointSync(self._s3, checkpoint_dir(self._job), S3Uri.parse(config["S3Uri"]),
                              self._jobs.settings.checkpoint_sync_seconds)

    def _train(self, checkpoints: CheckpointSync | None) -> int:
        """Run the container until it exits, is stopped, or outruns MaxRuntimeInSeconds."""
        job, settings = self._job, self._jobs.settings
        argv = settings.command(job.request["AlgorithmSpecification"]["TrainingImage"], "train")
        env = container_env({"ATELIER_OPT_ML": str(job.opt_ml), "TRAINING_JOB_NAME": job.name,
                             "TRAINING_JOB_ARN": job.arn}, job.request.get("Environment", {}))
        try:
            process = ContainerProcess(argv, env, settings.cwd, job.log_path)
        except OSError as error:
            raise JobFailure(f"ClientError: cannot start the container {argv}: {error}") from error
        if checkpoints:
            checkpoints.start()
        try:
            return self._supervise(process)
        finally:
            if checkpoints:
                checkpoints.stop()  # and a last sync, also after a failure

    def _supervise(self, process: ContainerProcess) -> int:
        job = self._job
        max_runtime = job.request["StoppingCondition"].get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
        deadline = (job.start_time or job.creation_time).timestamp() + max_runtime
        while (code := process.poll()) is None:
            if time.time() >= deadline:
                self._jobs.begin_stop(job, "MaxRuntimeExceeded")
            if job.stop_requested.wait(0.1):
                return process.stop(self._jobs.stop_grace())
        process.reap_group()
        return code

    def _upload_outputs(self) -> str:
        """model/ as model.tar.gz (and output/data as output.tar.gz when the job wrote any)."""
        job = self._job
        output = S3Uri.parse(job.request["OutputDataConfig"]["S3OutputPath"]).join(job.name, "output")
        data_dir = job.opt_ml / "output" / "data"
        if any(data_dir.iterdir()):
            upload(self._s3, archive(data_dir, job.root / "output.tar.gz"), output.join("output.tar.gz"))
        model = output.join("model.tar.gz")
        upload(self._s3, archive(job.opt_ml / "model", job.root / "model.tar.gz"), model)
        return str(model)

    def _finish_stopped(self) -> None:
        """Stopped: SageMaker still uploads what the container saved in model/ during its grace."""
        job = self._job
        artifacts = None
        if (job.opt_ml / "model").is_dir() and any((job.opt_ml / "model").iterdir()):
            try:
                artifacts = self._upload_outputs()
            except Exception:  # stopping must end Stopped even if S3 is gone
                logger.warning("could not upload the model of stopped job %s", job.name, exc_info=True)
        self._jobs.advance(job, "Stopped", job.stop_cause or "Stopped", model_artifacts=artifacts)

    def _fail(self, reason: str) -> None:
        if self._job.status == "Stopping":
            return self._finish_stopped()
        self._jobs.advance(self._job, "Failed", "Failed", failure_reason=reason[:MAX_FAILURE_REASON])


# --- the container's view: /opt/ml --------------------------------------------------------------

def normalise_request(request: dict[str, Any]) -> dict[str, Any]:
    """Check what the local runner needs and fill the defaults DescribeTrainingJob shows."""
    for member in ("RoleArn", "AlgorithmSpecification.TrainingImage", "OutputDataConfig.S3OutputPath",
                   "ResourceConfig", "StoppingCondition"):
        require(request, member)
    S3Uri.parse(request["OutputDataConfig"]["S3OutputPath"], "S3OutputPath")
    if request.get("CheckpointConfig"):
        S3Uri.parse(require(request, "CheckpointConfig.S3Uri"), "CheckpointConfig.S3Uri")
    normalised = json.loads(json.dumps(request))  # a deep copy the caller cannot change
    normalised.setdefault("HyperParameters", {})
    normalised["ResourceConfig"].setdefault("InstanceCount", 1)
    normalised["StoppingCondition"].setdefault("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
    if normalised.get("CheckpointConfig"):
        normalised["CheckpointConfig"].setdefault("LocalPath", CONTAINER_CHECKPOINTS)
    names = [require(channel, "ChannelName") for channel in normalised.get("InputDataConfig", [])]
    if len(names) != len(set(names)):
        raise validation_error(f"Channel names must be unique: {names}")
    for channel in normalised.get("InputDataConfig", []):
        source = channel.get("DataSource", {}).get("S3DataSource")
        if source:
            source.setdefault("S3DataDistributionType", "FullyReplicated")
            S3Uri.parse(require(source, "S3Uri"), "S3DataSource.S3Uri")
    return normalised


def check_supported(request: dict[str, Any]) -> None:
    """What this runner cannot do fails the job with a reason that says so."""
    if request["ResourceConfig"]["InstanceCount"] != 1:
        raise JobFailure("ClientError: local runner supports InstanceCount=1, got "
                         f"{request['ResourceConfig']['InstanceCount']}")
    for channel in request.get("InputDataConfig", []):
        source = channel.get("DataSource", {}).get("S3DataSource") or {}
        if source.get("S3DataType") not in ("S3Prefix", "ManifestFile"):
            raise JobFailure(f"ClientError: local runner supports S3DataSource with S3DataType S3Prefix or "
                             f"ManifestFile (channel {channel['ChannelName']})")


def write_layout(job: TrainingJob) -> Path:
    """The /opt/ml tree and its input/config files, as the SageMaker agent writes them."""
    opt_ml, request = job.opt_ml, job.request
    for sub in ("input/config", "input/data", "model", "output/data", "checkpoints"):
        (opt_ml / sub).mkdir(parents=True, exist_ok=True)
    config = opt_ml / "input" / "config"
    (config / "hyperparameters.json").write_text(
        json.dumps({key: str(value) for key, value in request["HyperParameters"].items()}))
    (config / "inputdataconfig.json").write_text(json.dumps(
        {c["ChannelName"]: channel_config(c, request) for c in request.get("InputDataConfig", [])}))
    (config / "resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "eth0"}))
    return opt_ml


def channel_config(channel: dict[str, Any], request: dict[str, Any]) -> dict[str, str]:
    source = channel["DataSource"].get("S3DataSource", {})
    config = {
        "TrainingInputMode": channel.get("InputMode") or request["AlgorithmSpecification"].get("TrainingInputMode",
                                                                                               "File"),
        "S3DistributionType": source.get("S3DataDistributionType", "FullyReplicated"),
        "RecordWrapperType": channel.get("RecordWrapperType", "None"),
    }
    if channel.get("ContentType"):
        config["ContentType"] = channel["ContentType"]
    return config


def materialise_channels(s3: Any, channels: list[dict[str, Any]], data_dir: Path) -> None:
    """Each channel's objects as files under input/data/<channel>/.

    File and FastFile both end as plain files here; with one instance ShardedByS3Key gives that
    instance every object.
    """
    for channel in channels:
        source = channel["DataSource"]["S3DataSource"]
        target = data_dir / channel["ChannelName"]
        target.mkdir(parents=True, exist_ok=True)
        uri = S3Uri.parse(source["S3Uri"])
        try:
            if source["S3DataType"] == "ManifestFile":
                count = download_manifest(s3, uri, target)
            else:
                count = len(download_prefix(s3, uri, target))
        except JobFailure:
            raise
        except Exception as error:  # any S3 problem is the caller's input problem
            raise JobFailure(f"ClientError: cannot download channel {channel['ChannelName']} from {uri}: "
                             f"{error}") from error
        if count == 0:
            raise JobFailure(f"ClientError: No S3 objects found under S3 URL \"{uri}\" given in input data "
                             f"source (channel {channel['ChannelName']}).")


def download_manifest(s3: Any, manifest_uri: S3Uri, target: Path) -> int:
    """A ManifestFile channel: [{"prefix": "s3://b/p/"}, "rel1", ...] gives prefix+rel at target/rel."""
    body = s3.get_object(Bucket=manifest_uri.bucket, Key=manifest_uri.key)["Body"].read()
    entries = json.loads(body)
    if not entries or not isinstance(entries[0], dict) or "prefix" not in entries[0]:
        raise JobFailure(f"ClientError: manifest {manifest_uri} must start with {{\"prefix\": \"s3://...\"}}")
    prefix = S3Uri.parse(entries[0]["prefix"])
    for relative in entries[1:]:
        download(s3, S3Uri(prefix.bucket, prefix.key + relative), inside(target, relative))
    return len(entries) - 1


def checkpoint_dir(job: TrainingJob) -> Path:
    """LocalPath under the job's opt_ml (/opt/ml/x maps to <opt_ml>/x)."""
    local = job.request["CheckpointConfig"].get("LocalPath", CONTAINER_CHECKPOINTS)
    if local.startswith("/opt/ml/"):
        return job.opt_ml / local.removeprefix("/opt/ml/")
    return job.opt_ml / "checkpoints"


def archive(directory: Path, target: Path) -> Path:
    """A tar.gz of the directory's contents, entries at the archive root, as SageMaker packs model/."""
    with tarfile.open(target, "w:gz") as tar:
        for child in sorted(directory.iterdir()):
            tar.add(child, arcname=child.name)
    return target


def failure_reason(job: TrainingJob, code: int) -> str:
    """output/failure when the container wrote one (SageMaker's contract), else the exit and log tail."""
    failure_file = job.opt_ml / "output" / "failure"
    if failure_file.is_file():
        text = failure_file.read_text(errors="replace").strip()
        if text:
            return text[:MAX_FAILURE_REASON]
    how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
    return f"AlgorithmError: {how}. Log {job.log_path} ends:\n{log_tail(job.log_path, lines=12)}"


def transition(status: str, start: datetime) -> dict[str, Any]:
    return {"Status": status, "StartTime": start, "StatusMessage": STATUS_MESSAGES.get(status, status)}


def tag_map(tags: list[dict[str, str]] | None) -> dict[str, str]:
    """Tags as events carry them: {key: value}."""
    return {tag["Key"]: tag.get("Value", "") for tag in tags or []}


# --- checkpoints ---------------------------------------------------------------------------------

class CheckpointSync:
    """Mirrors the checkpoint dir to CheckpointConfig.S3Uri as SageMaker does: restored into a new
    job before it starts, new or changed files uploaded every few seconds and once at the end.

    Deletions are not mirrored. The trainer writes atomically, so a walk sees whole files.
    """

    def __init__(self, s3: Any, local: Path, remote: S3Uri, interval: float):
        self._s3 = s3
        self._local = local
        self._remote = remote
        self._interval = interval
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def restore(self) -> int:
        """Everything under the S3Uri into the checkpoint dir: a new job resumes from it."""
        self._local.mkdir(parents=True, exist_ok=True)
        try:
            paths = download_prefix(self._s3, self._remote, self._local)
        except Exception as error:  # an S3 problem is the caller's input problem
            raise JobFailure(f"ClientError: cannot restore checkpoints from {self._remote}: {error}") from error
        for path in paths:
            self._uploaded[path.relative_to(self._local).as_posix()] = signature(path)
        return len(paths)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"checkpoints-{self._remote}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the periodic sync and upload what is left."""
        self._stopping.set()
        if self._thread:
            self._thread.join()
        try:
            self.sync()
        except Exception:  # the job's own outcome stands; the log says what is missing
            logger.warning("final checkpoint sync to %s failed", self._remote, exc_info=True)

    def sync(self) -> int:
        """Upload what is new or changed since the last sync; the number of files uploaded."""
        with self._lock:
            count = 0
            for path in sorted(p for p in self._local.rglob("*") if p.is_file()):
                relative = path.relative_to(self._local).as_posix()
                try:
                    current = signature(path)
                except FileNotFoundError:  # replaced or removed while walking
                    continue
                if self._uploaded.get(relative) != current:
                    upload(self._s3, path, self._remote.join(relative))
                    self._uploaded[relative] = current
                    count += 1
            return count

    def _loop(self) -> None:
        while not self._stopping.wait(self._interval):
            try:
                self.sync()
            except Exception:  # try again next round; the final sync reports
                logger.warning("checkpoint sync to %s failed", self._remote, exc_info=True)


def signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns

