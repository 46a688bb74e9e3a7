"""What the deploy stage reads from its events and answers for each: a training job's state, the job
behind a model artefact's key, the tags the pipeline puts on its jobs, and a step's result."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from contracts import job_tags, s3_layout
from core.errors import BadMessage

EVAL_SUFFIX = "-eval"
EVALUATE_SOURCE, EVALUATE_REQUEST = "atelier.cli", "Evaluate Model"  # `atelier evaluate MODEL` puts this event
ROLE_TAG, CANDIDATE_TAG, TRAINING_JOB_TAG = job_tags.ROLE, job_tags.CANDIDATE, job_tags.TRAINING_JOB
FINAL_STAGE_TAG, MANIFEST_TAG = job_tags.FINAL_STAGE, job_tags.MANIFEST
ARTEFACT_SUFFIX = f"/output/{s3_layout.MODEL_ARCHIVE}"


@dataclass(frozen=True)
class JobState:
    name: str
    status: str
    model_data_url: str | None
    failure_reason: str | None
    final_stage: bool = True  # a run plan's earlier stages train on; only the last is served
    tags: tuple[tuple[str, str], ...] = ()
    ended_at: int = 0  # TrainingEndTime in epoch milliseconds: what "newer" means

    @property
    def tag_map(self) -> dict[str, str]:
        return dict(self.tags)

    @property
    def is_evaluation(self) -> bool:
        return self.tag_map.get(ROLE_TAG) == "evaluation" or self.name.endswith(EVAL_SUFFIX)


@dataclass(frozen=True)
class DeployResult:
    action: str  # recorded | evaluating | held-back | eval-failed | superseded | created | updated | duplicate | ...
    model: str | None = None
    reason: str = ""


def job_state_from_event(detail: dict[str, Any]) -> JobState:
    """A Training Job State Change's detail (or a DescribeTrainingJob answer with its tags) -> JobState."""
    try:
        tags = _tags(detail.get("Tags"))
        return JobState(
            name=detail["TrainingJobName"],
            status=detail["TrainingJobStatus"],
            model_data_url=(detail.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
            failure_reason=detail.get("FailureReason"),
            final_stage=tags.get(FINAL_STAGE_TAG, "true") != "false",
            tags=tuple(sorted(tags.items())),
            ended_at=_epoch_ms(detail.get("TrainingEndTime") or detail.get("LastModifiedTime")),
        )
    except KeyError as exc:
        raise BadMessage(f"training job state change without {exc}") from exc


def job_from_artefact_key(key: str) -> str:
    """`training/<job>/output/model.tar.gz` -> the job's name."""
    if not key.startswith(s3_layout.TRAINING) or not key.endswith(ARTEFACT_SUFFIX):
        raise BadMessage(f"{key} is not a training job's model artefact")
    return key.removeprefix(s3_layout.TRAINING).removesuffix(ARTEFACT_SUFFIX)


def _tags(tags: object) -> dict[str, str]:
    """Event details carry tags as a map; DescribeTrainingJob-style lists are read too."""
    if isinstance(tags, dict):
        return {str(k): str(v) for k, v in tags.items()}
    if isinstance(tags, list):
        return {str(t.get("Key")): str(t.get("Value")) for t in tags if isinstance(t, dict)}
    return {}


def _epoch_ms(value: object) -> int:
    """Event times are epoch milliseconds; boto3 gives datetimes; ISO text is read too."""
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str) and value:
        return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)
    return 0
