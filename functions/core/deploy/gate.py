"""The evaluation gate: may a candidate model replace the one in production?

Pure: it reads the evaluation job's `evaluation.json` (trainer/jobs/evaluate.py writes it) and decides
from the candidate's scores, production's scores on the same evaluation set, and the thresholds
(the recipe's evaluation.max_loss, max_loss_ratio and min_clip_delta; docs/deploy.md, docs/recipe.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import BadMessage


@dataclass(frozen=True)
class Scores:
    """One model's scores on one evaluation set."""

    eval_set: str  # the evaluation set's digest: scores compare only on the same set
    val_loss: float | None  # None: the loss was not finite
    clip_score: float | None = None  # None: no scorer was available
    measure: str = ""  # what val_loss measures (its prediction, timesteps and resolution): losses compare only alike

    def to_item(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> "Scores":
        number = lambda v: None if v in (None, "") else float(v)  # noqa: E731 (DynamoDB stores numbers as text here)
        return cls(eval_set=str(item["eval_set"]), val_loss=number(item.get("val_loss")),
                   clip_score=number(item.get("clip_score")), measure=str(item.get("measure") or ""))


@dataclass(frozen=True)
class Thresholds:
    max_loss: float  # a candidate above this validation loss never ships, production or not
    max_loss_ratio: float  # candidate loss / production loss must stay at or below this
    min_clip_delta: float  # candidate CLIP score may trail production's by at most this


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    reason: str


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation job measured: the candidate, and production when it was given."""

    candidate: Scores
    baseline: Scores | None


def parse_evaluation(document: bytes) -> Evaluation:
    """evaluation.json -> scores; BadMessage when it is not the schema the trainer writes."""
    try:
        data = json.loads(document)
        digest = str(data["eval_set"]["digest"])
        models = data["models"]
        resolution = (data.get("config") or {}).get("resolution")
        candidate = _scores(digest, models["candidate"], resolution)
        baseline = _scores(digest, models["baseline"], resolution) if models.get("baseline") else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadMessage(f"evaluation.json is not schema 1: {exc!r}") from exc
    return Evaluation(candidate, baseline)


def _scores(digest: str, block: dict[str, Any], resolution: Any) -> Scores:
    measure = str(block.get("val_loss_measure") or "")
    if measure and resolution:
        measure = f"{measure} at {resolution} px"
    return Scores(eval_set=digest, val_loss=_finite(block.get("val_loss")), clip_score=_finite(block.get("clip_score")),
                  measure=measure)


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def decide(candidate: Scores, production: Scores | None, thresholds: Thresholds) -> GateVerdict:
    """Pass only a finite loss under the absolute bound that is not worse than production's."""
    if candidate.val_loss is None:
        return GateVerdict(False, "validation loss is not finite")
    if candidate.val_loss > thresholds.max_loss:
        return GateVerdict(False, f"validation loss {candidate.val_loss:.4f} is above the limit {thresholds.max_loss:g}")
    if production is None or production.val_loss is None:
        return GateVerdict(True, f"validation loss {candidate.val_loss:.4f} within the limit; "
                              "no production model to compare")
    if production.eval_set != candidate.eval_set:
        return GateVerdict(False, "production was scored on another evaluation set")  # the caller re-evaluates
    if production.measure != candidate.measure:
        return _decide_on_clip(candidate, production, thresholds)
    ratio = candidate.val_loss / production.val_loss if production.val_loss > 0 else math.inf
    if ratio > thresholds.max_loss_ratio:
        return GateVerdict(False, f"validation loss {candidate.val_loss:.4f} is {ratio:.3f}x production's "
                               f"{production.val_loss:.4f} (limit {thresholds.max_loss_ratio:g}x)")
    if candidate.clip_score is not None and production.clip_score is not None:
        if candidate.clip_score < production.clip_score - thresholds.min_clip_delta:
            return GateVerdict(False, f"CLIP score {candidate.clip_score:.2f} trails production's "
                                   f"{production.clip_score:.2f} by more than {thresholds.min_clip_delta:g}")
    clip = "" if candidate.clip_score is None else f", CLIP {candidate.clip_score:.2f}"
    return GateVerdict(True, f"validation loss {candidate.val_loss:.4f} is {ratio:.3f}x production's{clip}")


def _decide_on_clip(candidate: Scores, production: Scores, thresholds: Thresholds) -> GateVerdict:
    """Candidate and production losses that measure different things (a flow model's velocity against a UNet's
    epsilon or v, other timesteps, another resolution) have no meaningful ratio: the CLIP scores decide, or,
    without them, nothing shows the candidate is as good, and it is held back."""
    losses = f"the candidate's loss ({candidate.measure or 'unstated'}) and production's ({production.measure or 'unstated'}) measure different things"
    if candidate.clip_score is None or production.clip_score is None:
        return GateVerdict(False, f"{losses}, and there is no CLIP score for both to compare instead "
                                  "(give the evaluation a CLIP model: evaluation.clip_model_uri)")
    if candidate.clip_score < production.clip_score - thresholds.min_clip_delta:
        return GateVerdict(False, f"{losses}; CLIP score {candidate.clip_score:.2f} trails production's "
                                  f"{production.clip_score:.2f} by more than {thresholds.min_clip_delta:g}")
    return GateVerdict(True, f"{losses}; CLIP score {candidate.clip_score:.2f} against production's {production.clip_score:.2f}")
