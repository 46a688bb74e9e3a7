"""core.deploy.gate: the evaluation gate's decision from scores and thresholds, and evaluation.json parsing."""

from __future__ import annotations

import json

import pytest

from core.deploy.gate import Scores, Thresholds, decide, parse_evaluation
from core.errors import BadMessage

LIMITS = Thresholds(max_loss=1.0, max_loss_ratio=1.05, min_clip_delta=0.5)
SET = "e" * 64


FLOW, V = "flow velocity at t = 0, 1/8, ..., 7/8 at 256 px", "v_prediction at timesteps 100,500,900 at 256 px"


def scores(loss: float | None, clip: float | None = None, eval_set: str = SET, measure: str = "") -> Scores:
    return Scores(eval_set=eval_set, val_loss=loss, clip_score=clip, measure=measure)


@pytest.mark.parametrize(("candidate", "production", "passed", "reason"), [
    (scores(0.5), None, True, "no production model to compare"),
    (scores(None), None, False, "not finite"),
    (scores(1.5), None, False, "above the limit 1"),
    (scores(0.5), scores(0.5), True, "1.000x production's"),
    (scores(0.525), scores(0.5), True, "1.050x"),  # exactly at the ratio passes
    (scores(0.53), scores(0.5), False, "1.060x production's 0.5000 (limit 1.05x)"),
    (scores(0.5, clip=25.0), scores(0.5, clip=25.4), True, "CLIP 25.00"),
    (scores(0.5, clip=24.0), scores(0.5, clip=25.0), False, "CLIP score 24.00 trails"),
    (scores(0.5, clip=24.0), scores(0.5), True, ""),  # production has no CLIP score: loss decides
    (scores(0.5), scores(0.4, eval_set="f" * 64), False, "another evaluation set"),
    (scores(0.5), scores(None), True, "no production model to compare"),
    (scores(0.3, measure=FLOW), scores(0.05, measure=FLOW), False, "6.000x production's"),  # alike: the ratio decides
    # a flow model's velocity loss against a UNet's v loss: no ratio; CLIP decides, or nothing shows it is as good
    (scores(0.3, measure=FLOW), scores(0.05, measure=V), False, "measure different things, and there is no CLIP score"),
    (scores(0.3, clip=25.0, measure=FLOW), scores(0.05, clip=25.3, measure=V), True, "CLIP score 25.00 against production's 25.30"),
    (scores(0.3, clip=24.0, measure=FLOW), scores(0.05, clip=25.0, measure=V), False, "CLIP score 24.00 trails"),
    (scores(0.3, clip=25.0, measure=FLOW), scores(0.3, clip=25.0, measure=FLOW.replace("256", "512")), True,
     "measure different things; CLIP"),  # another resolution is another measure
    (scores(1.5, clip=30.0, measure=FLOW), scores(0.05, clip=25.0, measure=V), False, "above the limit 1"),
])
def test_decide(candidate: Scores, production: Scores | None, passed: bool, reason: str) -> None:
    decision = decide(candidate, production, LIMITS)

    assert decision.passed is passed
    assert reason in decision.reason


def test_parse_evaluation_reads_candidate_and_baseline() -> None:
    document = {"schema": 1, "eval_set": {"digest": SET, "samples": 3}, "config": {"resolution": 256},
                "models": {"candidate": {"val_loss": 0.25, "clip_score": None, "val_loss_measure": "flow velocity at t = 0, 1/8, ..., 7/8"},
                           "baseline": {"val_loss": "NaN", "clip_score": 30.5, "val_loss_measure": "v_prediction at timesteps 100,500,900"}}}

    evaluation = parse_evaluation(json.dumps(document).encode())

    assert evaluation.candidate == scores(0.25, measure=FLOW)
    assert evaluation.baseline == scores(None, clip=30.5, measure=V)


def test_parse_evaluation_without_baseline() -> None:
    document = {"schema": 1, "eval_set": {"digest": SET}, "models": {"candidate": {"val_loss": 0.25}}}

    assert parse_evaluation(json.dumps(document).encode()).baseline is None


@pytest.mark.parametrize("document", [b"not json", b"{}", b'{"eval_set": {"digest": "x"}, "models": {}}'])
def test_parse_evaluation_rejects_other_documents(document: bytes) -> None:
    with pytest.raises(BadMessage, match="evaluation.json"):
        parse_evaluation(document)


def test_scores_survive_a_record_round_trip() -> None:
    original = scores(0.123456789, clip=31.25, measure=FLOW)

    assert Scores.from_item(original.to_item()) == original
