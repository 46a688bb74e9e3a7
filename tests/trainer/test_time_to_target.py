"""bench/time_to_target.py's scoring rules: the target from the peer's first checkpoint that draws the prompts,
the prompts drawn only until then, and each run's time to that loss."""

import argparse
import json
from pathlib import Path

import pytest

from bench import time_to_target as ttt
from bench import time_to_target_runs as runs
from trainer.jobs import scoring

LOSSES = {150: 0.14, 300: 0.09, 450: 0.07, 600: 0.06, 750: 0.05}
MATCHES = {150: 0.1, 300: 0.3, 450: 0.8, 600: 0.9, 750: 1.0}


def run_of(tmp_path: Path, name: str, seconds_per_step: float) -> ttt.Run:
    run = ttt.Run(name)
    for step in LOSSES:
        unet = tmp_path / name / str(step) / "unet"
        unet.mkdir(parents=True)
        (unet / "step").write_text(str(step))
        run.checkpoints[step], run.directories[step] = step * seconds_per_step, unet
    return run


def fake_scoring(monkeypatch, drawn: list) -> None:
    def step_of(folder: Path) -> int:
        return int((folder / "unet" / "step").read_text())

    monkeypatch.setattr(scoring, "score_model", lambda folder, *rest: {"val_loss": LOSSES[step_of(folder)]})

    def match_rate(folder, config, device):
        drawn.append(step_of(folder))
        return MATCHES[step_of(folder)]
    monkeypatch.setattr(ttt, "match_rate", match_rate)


def test_the_peer_draws_prompts_until_its_first_match_and_ours_only_at_its_target(tmp_path, monkeypatch):
    # GIVEN a base pipeline, the peer's checkpoints and ours (twice as fast a step), scored by fakes
    (tmp_path / "base" / "unet").mkdir(parents=True)
    (tmp_path / "base" / "model_index.json").write_text("{}")
    peer, ours = run_of(tmp_path, "diffusers", 0.2), run_of(tmp_path, "ours", 0.1)
    drawn: list[int] = []
    fake_scoring(monkeypatch, drawn)
    monkeypatch.setattr(runs, "OUT", [])
    # WHEN both are scored as main() does
    peer_scores = ttt.score(peer, tmp_path, [], None, None, match_until=0.8)
    ours_scores = ttt.score(ours, tmp_path, [], None, None)
    args = argparse.Namespace(target="match", match_goal=0.8, target_slack=1.0, steps=750)
    target, rule = ttt.target_of(args, peer_scores)
    ours_step, ours_s = ttt.time_to(target, ours, ours_scores)
    ttt.match_at(ours, ours_step, tmp_path, ours_scores, None, None)
    # THEN the peer drew until step 450 (its first 0.8), which sets the target; ours reaches it at 450 in half the time
    assert drawn == [150, 300, 450, 450]
    assert target == LOSSES[450] and "(step 450)" in rule
    assert ttt.time_to(target, peer, peer_scores) == (450, 90.0)
    assert (ours_step, ours_s) == (450, 45.0)
    assert json.loads((tmp_path / "ours-scores.json").read_text())["450"]["match"] == 0.8
    # and a second scoring reads the records instead of drawing again
    ttt.score(peer, tmp_path, [], None, None, match_until=0.8)
    assert drawn == [150, 300, 450, 450]


def test_no_target_when_the_peer_never_draws_the_prompts():
    args = argparse.Namespace(target="match", match_goal=0.8, target_slack=1.0, steps=300)
    target, rule = ttt.target_of(args, {150: {"val_loss": 0.1, "match": 0.2}, 300: {"val_loss": 0.09, "match": 0.7}})
    assert target is None and rule == "the peer never matched 0.8 of the prompts in 300 steps"


def test_a_recorded_run_is_read_back_under_its_own_name_instead_of_run_again(tmp_path):
    # GIVEN the peer's run (named "diffusers") timed under the record name "peer"
    made = ttt.Run("diffusers", 5.0, {150: 12.5}, {150: tmp_path / "checkpoint-150" / "unet"}, {"encoded_s": 3.0})
    assert runs.timed(tmp_path, "peer", lambda: made) is made
    # WHEN a later call asks for it without a runner
    again = runs.timed(tmp_path, "peer", None)
    # THEN it is the recorded run, from the record (its start is not kept: times are from it)
    assert again == ttt.Run("diffusers", 0.0, {150: 12.5}, {150: tmp_path / "checkpoint-150" / "unet"}, {"encoded_s": 3.0})


def test_a_record_without_a_name_is_its_file_s_and_a_missing_one_without_a_runner_is_an_error(tmp_path):
    # records bench/family_ttt.py wrote before they held the name
    (tmp_path / "dit-run.json").write_text(json.dumps({"checkpoints": {"10": 4.0}, "phases": {}, "directories": {"10": "/x"}}))
    assert runs.timed(tmp_path, "dit", None) == ttt.Run("dit", 0.0, {10: 4.0}, {10: Path("/x")}, {})
    with pytest.raises(FileNotFoundError):
        runs.timed(tmp_path, "unet", None)


@pytest.mark.parametrize("denoiser", ["unet", "transformer"])
def test_a_scoring_pipeline_is_the_base_linked_with_the_checkpoint_s_denoiser_in_its_place(tmp_path, denoiser):
    base, checkpoint = tmp_path / "base", tmp_path / "step-150" / denoiser
    for part in (denoiser, "vae", "scheduler"):
        (base / part).mkdir(parents=True)
    (base / "model_index.json").write_text("{}")
    checkpoint.mkdir(parents=True)
    folder = runs.pipeline_with(base, checkpoint, tmp_path / "scoring" / "ours-150")
    assert {path.name: path.resolve() for path in folder.iterdir()} == {
        denoiser: checkpoint, "vae": base / "vae", "scheduler": base / "scheduler", "model_index.json": base / "model_index.json"}
    assert all(path.is_symlink() for path in folder.iterdir())


def test_the_plot_has_a_match_panel_only_when_prompts_were_drawn(tmp_path):
    run = run_of(tmp_path, "ours", 0.1)
    losses_only = {step: {"val_loss": loss} for step, loss in LOSSES.items()}  # --skip-match or --target final
    one_drawn = {**losses_only, 450: {"val_loss": LOSSES[450], "match": MATCHES[450]}}
    assert not ttt.drew_prompts([(run, losses_only)])
    assert ttt.drew_prompts([(run, losses_only), (run, one_drawn)])


def test_the_timeline_records_when_each_job_event_first_shows():
    run = ttt.Run("ours", started=100.0)
    seen = runs.timeline(run, "train")
    seen(b'Loading weights\n{"event": "data", "samples": 2}\n{"event": "compile_cache", "loaded": []}\n', 112.34)
    seen(b'{"step": 150, "loss": 0.1}\n{"event": "compile_cache", "loaded": ["x"]}\n{"event": "start", "step": 0}\n', 130.0)
    assert run.phases == {"train.data_s": 12.3, "train.compile_cache_s": 12.3, "train.start_s": 30.0}
