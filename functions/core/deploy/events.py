"""What the deploy stage reads from its events and answers for each: a training job's state, the job
behind a model artefact's key, the tags the pipeline puts on its jobs, and a step's result.

What a job is (a run-plan job, final or not; an encode, autoencoder or evaluation job) is read
from its tags alone, never from its name or a default: a job whose tags do not say is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from contracts import job_tags, s3_layout
from core.errors import BadMessage

EVAL_SUFFIX = "-eval"
EVALUATE_SOURCE, EVALUATE_REQUEST = "atelier.cli", "Evaluate Model"  # `atelier evaluate MODEL` puts this event
ROLLBACK_REQUEST = "Roll Back Endpoint"  # `atelier rollback` puts this event (source EVALUATE_SOURCE)
ROLE_TAG, CANDIDATE_TAG, TRAINING_JOB_TAG = job_tags.ROLE, job_tags.CANDIDATE, job_tags.TRAINING_JOB
FINAL_PLANNED_JOB_TAG, MANIFEST_TAG = job_tags.FINAL_PLANNED_JOB, job_tags.MANIFEST
ROLES = (job_tags.ENCODE, job_tags.AUTOENCODER, job_tags.TOKENIZER, job_tags.EVALUATION)
ARTEFACT_SUFFIX = f"/output/{s3_layout.MODEL_ARCHIVE}"


@dataclass(frozen=True)
class JobState:
    name: str
    status: str
    model_data_url: str | None
    failure_reason: str | None
    tags: tuple[tuple[str, str], ...] = ()
    ended_at: int = 0  # TrainingEndTime in epoch milliseconds: what "newer" means

    @property
    def tag_map(self) -> dict[str, str]:
        return dict(self.tags)

    @property
    def final_planned_job(self) -> bool:
        """A run plan's earlier jobs train on; only the last, tagged so, is served."""
        return self.tag_map.get(FINAL_PLANNED_JOB_TAG) == "true" and ROLE_TAG not in self.tag_map

    @property
    def is_evaluation(self) -> bool:
        return self.tag_map.get(ROLE_TAG) == job_tags.EVALUATION

    @property
    def unidentified(self) -> str:
        """Why the tags do not say what the job is, "" when they do: a helper or evaluation job by its
        role, a run-plan job by its final-stage tag and the manifest it trained on."""
        tags = self.tag_map
        if ROLE_TAG in tags:
            return "" if tags[ROLE_TAG] in ROLES else f"{ROLE_TAG} is {tags[ROLE_TAG]!r}, no role the pipeline gives"
        if tags.get(FINAL_PLANNED_JOB_TAG) not in {"true", "false"} or not tags.get(MANIFEST_TAG):
            return f"no {ROLE_TAG}, and not both {FINAL_PLANNED_JOB_TAG} (true or false) and {MANIFEST_TAG}"
        return ""


@dataclass(frozen=True)
class DeployResult:
    action: str  # recorded | evaluating | held-back | eval-failed | superseded | created | updated | duplicate | ...
    model: str | None = None
    reason: str = ""


def job_state_from_event(detail: dict[str, Any]) -> JobState:
    """A Training Job State Change's detail (or a DescribeTrainingJob answer) -> JobState, with the
    tags the event carries (an event may carry none: core.deploy.candidates reads them then)."""
    try:
        tags = _tags(detail.get("Tags"))
        return JobState(
            name=detail["TrainingJobName"],
            status=detail["TrainingJobStatus"],
            model_data_url=(detail.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
            failure_reason=detail.get("FailureReason"),
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
