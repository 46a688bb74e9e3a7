"""One training job's run, as SageMaker runs it: one container per instance, attempt after attempt.

Each of the job's InstanceCount instances (algo-1..algo-N) runs the container once per attempt over
its own /opt/ml (ATELIER_OPT_ML), with its share of the channels and its checkpoint dir mirrored to
S3 (training_instances.py). An attempt that loses an instance fails as an InternalServerError and,
within RetryStrategy.MaximumRetryAttempts, the job starts over on new instances that restore the
checkpoints; a container's own failure is not retried.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atelier.local.sagemaker.containers import ContainerProcess, container_env, free_port, log_tail
from atelier.local.sagemaker.documents import utc_now
from atelier.local.sagemaker.s3_transfers import S3Uri, upload
from atelier.local.sagemaker.training_instances import (
    CheckpointSync,
    Instance,
    JobFailure,
    archive,
    has_files,
    materialise_channels,
    write_layout,
)

if TYPE_CHECKING:  # for annotations only: training_jobs imports this module
    from atelier.local.sagemaker.training_jobs import TrainingJob, TrainingJobs

logger = logging.getLogger(__name__)

MAX_FAILURE_REASON = 1024
# What SageMaker reports for a failure of its own (the class RetryStrategy retries).
INTERNAL_ERROR = "InternalServerError: We encountered an internal error. Please try again."
# Every emulated instance is this machine: the containers' rendezvous address (trainer/container.py).
LOOPBACK = "127.0.0.1"


class InstanceLost(Exception):
    """An attempt lost an instance: SageMaker's own failure, retried under RetryStrategy."""


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
        job.loss_trigger.next_attempt()
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
                                       self._jobs.settings.checkpoint_sync_seconds, self._job.loss_trigger)
                for i in self._job.instances}

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
        if not end.lost and (lost := job.loss_trigger.fired):  # the containers ended before the sync saw it
            end = Exit(lost=next(i for i in job.instances if i.host == lost))
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
        max_runtime = job.request["StoppingCondition"]["MaxRuntimeInSeconds"]
        deadline = (job.start_time or job.creation_time).timestamp() + max_runtime
        running = dict(containers)
        while running:
            if lost := self._take_lost_host() or job.loss_trigger.fired:
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
