"""The emulated instances of a training job: each one's /opt/ml, channel share and checkpoint sync.

SageMaker runs a job on InstanceCount instances named algo-1..algo-N, one container each. Every
container has its own /opt/ml: the same config files but for `current_host`, each channel holding
every object (FullyReplicated) or only this instance's share (ShardedByS3Key), and its own
checkpoint dir, synced to the job's one CheckpointConfig.S3Uri. At the end SageMaker gathers every
instance's model/ (and output/data/) into one archive. A retry runs on new instances: new trees.
"""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atelier.local.sagemaker.s3_transfers import (
    S3Uri,
    download,
    download_prefix,
    inside,
    list_keys,
    relative_key,
    upload,
)

logger = logging.getLogger(__name__)

CONTAINER_CHECKPOINTS = "/opt/ml/checkpoints"
CONTAINER_TENSORBOARD = "/opt/ml/output/tensorboard"  # TensorBoardOutputConfig.LocalPath's default
INSTANCE_GROUP = "homogeneousCluster"  # the group name SageMaker gives a job without InstanceGroups


class JobFailure(Exception):
    """Ends a job as Failed with this FailureReason."""


@dataclass(frozen=True)
class Instance:
    """algo-<number>: its directory under the job's, holding opt_ml/ and logs.txt."""

    number: int
    root: Path

    @property
    def host(self) -> str:
        return f"algo-{self.number}"

    @property
    def opt_ml(self) -> Path:
        return self.root / "opt_ml"

    @property
    def log_path(self) -> Path:
        return self.root / "logs.txt"

    def checkpoint_dir(self, request: dict[str, Any]) -> Path:
        """CheckpointConfig.LocalPath inside this instance's tree (/opt/ml/x maps to <opt_ml>/x)."""
        local = request["CheckpointConfig"].get("LocalPath", CONTAINER_CHECKPOINTS)
        if local.startswith("/opt/ml/"):
            return self.opt_ml / local.removeprefix("/opt/ml/")
        return self.opt_ml / "checkpoints"

    def tensorboard_dir(self, request: dict[str, Any]) -> Path:
        """TensorBoardOutputConfig.LocalPath inside this instance's tree."""
        local = request["TensorBoardOutputConfig"].get("LocalPath", CONTAINER_TENSORBOARD)
        if local.startswith("/opt/ml/"):
            return self.opt_ml / local.removeprefix("/opt/ml/")
        return self.opt_ml / "output" / "tensorboard"


def job_instances(job_root: Path, count: int) -> list[Instance]:
    return [Instance(number, job_root / f"algo-{number}") for number in range(1, count + 1)]


def host_names(count: int) -> list[str]:
    """The hosts as resourceconfig.json lists them: sorted lexicographically (algo-10 before algo-2)."""
    return sorted(f"algo-{number}" for number in range(1, count + 1))


# --- /opt/ml -------------------------------------------------------------------------------------

def write_layout(instance: Instance, request: dict[str, Any]) -> None:
    """A fresh /opt/ml with its input/config files, as the SageMaker agent writes them on a new instance."""
    shutil.rmtree(instance.opt_ml, ignore_errors=True)
    for sub in ("input/config", "input/data", "model", "output/data", "checkpoints"):
        (instance.opt_ml / sub).mkdir(parents=True, exist_ok=True)
    config = instance.opt_ml / "input" / "config"
    (config / "hyperparameters.json").write_text(
        json.dumps({key: str(value) for key, value in request["HyperParameters"].items()}))
    (config / "inputdataconfig.json").write_text(json.dumps(
        {c["ChannelName"]: channel_config(c, request) for c in request.get("InputDataConfig", [])}))
    (config / "resourceconfig.json").write_text(json.dumps(resource_config(instance.host, request["ResourceConfig"])))


def resource_config(host: str, resources: dict[str, Any]) -> dict[str, Any]:
    """resourceconfig.json of one host of a homogeneous cluster."""
    hosts = host_names(resources["InstanceCount"])
    instance_type = resources.get("InstanceType", "local")
    return {"current_host": host, "current_instance_type": instance_type, "current_group_name": INSTANCE_GROUP,
            "hosts": hosts, "instance_groups": [{"instance_group_name": INSTANCE_GROUP,
                                                  "instance_type": instance_type, "hosts": hosts}],
            "network_interface_name": "eth0"}


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


# --- channels ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChannelObject:
    uri: S3Uri
    path: str  # where it lands under the channel dir


def materialise_channels(s3: Any, channels: list[dict[str, Any]], instances: list[Instance]) -> None:
    """Each channel's objects as files under every instance's input/data/<channel>/.

    File and FastFile both end as plain files. ShardedByS3Key gives instance k of n the objects
    k-1, k-1+n, ... of the key-sorted list (see share()); FullyReplicated gives each all of them.
    """
    for channel in channels:
        source = channel["DataSource"]["S3DataSource"]
        uri = S3Uri.parse(source["S3Uri"])
        try:
            objects = channel_objects(s3, source["S3DataType"], uri)
            if not objects:
                raise JobFailure(f"ClientError: No S3 objects found under S3 URL \"{uri}\" given in input data "
                                 f"source (channel {channel['ChannelName']}).")
            for instance in instances:
                target = instance.opt_ml / "input" / "data" / channel["ChannelName"]
                target.mkdir(parents=True, exist_ok=True)
                for item in share(objects, instance.number - 1, len(instances), source["S3DataDistributionType"]):
                    download(s3, item.uri, inside(target, item.path))
        except JobFailure:
            raise
        except Exception as error:  # any S3 problem is the caller's input problem
            raise JobFailure(f"ClientError: cannot download channel {channel['ChannelName']} from {uri}: "
                             f"{error}") from error


def channel_objects(s3: Any, data_type: str, uri: S3Uri) -> list[ChannelObject]:
    """S3Prefix: every object under the prefix, its path after the prefix. ManifestFile
    ([{"prefix": "s3://b/p/"}, "rel1", ...]): prefix+rel at rel."""
    if data_type != "ManifestFile":
        return [ChannelObject(S3Uri(uri.bucket, key), relative_key(key, uri.key)) for key in list_keys(s3, uri)]
    entries = json.loads(s3.get_object(Bucket=uri.bucket, Key=uri.key)["Body"].read())
    if not entries or not isinstance(entries[0], dict) or "prefix" not in entries[0]:
        raise JobFailure(f"ClientError: manifest {uri} must start with {{\"prefix\": \"s3://...\"}}")
    prefix = S3Uri.parse(entries[0]["prefix"])
    return [ChannelObject(S3Uri(prefix.bucket, prefix.key + relative), relative) for relative in entries[1:]]


def share(objects: list[ChannelObject], index: int, count: int, distribution: str) -> list[ChannelObject]:
    """The objects instance `index` (0-based) of `count` receives.

    SageMaker documents only that ShardedByS3Key gives each instance about 1/n of the objects (an
    instance may get none when there are fewer objects than instances); which instance gets which
    is unspecified. Here: the objects sorted by bucket and key, dealt round-robin, so shares differ
    by at most one object and are disjoint, and their union is the channel.
    """
    if distribution != "ShardedByS3Key" or count == 1:
        return list(objects)
    ordered = sorted(objects, key=lambda item: (item.uri.bucket, item.uri.key))
    return ordered[index::count]


# --- outputs -------------------------------------------------------------------------------------

def archive(directories: list[Path], target: Path) -> Path:
    """One tar.gz of the directories' contents, entries at the archive root, as SageMaker gathers
    every instance's model/ (or output/data/) into one archive.

    The documentation asks instances not to write clashing names; here the first directory's file
    wins a clash and the others are logged and left out.
    """
    seen: set[str] = set()
    with tarfile.open(target, "w:gz") as tar:
        for directory in directories:
            for path in sorted(directory.rglob("*")):
                name = path.relative_to(directory).as_posix()
                if name in seen:
                    if not path.is_dir():
                        logger.warning("%s clashes with a file of an earlier instance; left out of %s", path, target)
                    continue
                seen.add(name)
                tar.add(path, arcname=name, recursive=False)
    return target


def has_files(directories: list[Path]) -> bool:
    return any(directory.is_dir() and any(directory.iterdir()) for directory in directories)


# --- checkpoints ---------------------------------------------------------------------------------

class LossTrigger:
    """Fault injection: one instance of a job lost at the first moment a condition holds, tested after
    each checkpoint upload (LocalSageMaker.lose_training_instance(..., once=...)).

    Once it holds, no checkpoint of that attempt reaches S3 and the attempt counts as having lost the
    instance, even where its containers ended first. So S3 holds what it held at that moment, and the
    retry resumes from that, however fast or slow the containers ran.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one upload and its test at a time, over every instance's sync
        self._armed: tuple[str, Callable[[], bool]] | None = None
        self._fired: str | None = None

    def arm(self, host: str, condition: Callable[[], bool]) -> None:
        with self._lock:
            self._armed = (host, condition)

    @property
    def fired(self) -> str | None:
        """The host lost in this attempt, once the condition has held."""
        return self._fired

    def next_attempt(self) -> None:
        with self._lock:
            self._fired = None

    def upload(self, send: Callable[[], None]) -> bool:
        """send() one checkpoint file, then test the condition; False, sending nothing, once it held."""
        with self._lock:
            if self._fired:
                return False
            send()
            if self._armed and self._armed[1]():
                self._fired, self._armed = self._armed[0], None
            return True


class CheckpointSync:
    """Mirrors one instance's checkpoint dir to CheckpointConfig.S3Uri as SageMaker does: restored
    into every instance before it starts, new or changed files uploaded every few seconds and once
    when its container ends (not when the instance is lost).

    Every instance syncs to the same prefix, as in SageMaker (the last upload of a key wins).
    Deletions are not mirrored. Files go up oldest-modified first, so a marker written after its
    checkpoint (the trainer's `latest`) never reaches S3 before the files it names.
    """

    def __init__(self, s3: Any, local: Path, remote: S3Uri, interval: float, trigger: LossTrigger):
        self._s3 = s3
        self._local = local
        self._remote = remote
        self._interval = interval
        self._trigger = trigger
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def restore(self) -> int:
        """Everything under the S3Uri into the checkpoint dir: a new job (or attempt) resumes from it."""
        self._local.mkdir(parents=True, exist_ok=True)
        try:
            paths = download_prefix(self._s3, self._remote, self._local)
        except Exception as error:  # an S3 problem is the caller's input problem
            raise JobFailure(f"ClientError: cannot restore checkpoints from {self._remote}: {error}") from error
        for path in paths:
            self._uploaded[path.relative_to(self._local).as_posix()] = signature(path)
        return len(paths)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"checkpoints-{self._local}", daemon=True)
        self._thread.start()

    def stop(self, final_sync: bool = True) -> None:
        """End the periodic sync and, unless the instance is gone, upload what is left."""
        self._stopping.set()
        if self._thread:
            self._thread.join()
        if not final_sync:
            return
        try:
            self.sync()
        except Exception:  # the job's own outcome stands; the log says what is missing
            logger.warning("final checkpoint sync to %s failed", self._remote, exc_info=True)

    def sync(self) -> int:
        """Upload what is new or changed since the last sync; the number of files uploaded."""
        with self._lock:
            changed = []
            for path in self._local.rglob("*"):
                try:
                    if path.is_file():
                        changed.append((signature(path), path))
                except FileNotFoundError:  # replaced or removed while walking
                    continue
            count = 0
            for current, path in sorted(changed, key=lambda item: (item[0][1], item[1])):
                relative = path.relative_to(self._local).as_posix()
                if self._uploaded.get(relative) == current:
                    continue
                try:
                    target = self._remote.join(relative)
                    if not self._trigger.upload(lambda: upload(self._s3, path, target)):
                        break  # the instance is lost: nothing more of this attempt reaches S3
                except FileNotFoundError:  # removed since the walk (a pruned checkpoint)
                    continue
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
