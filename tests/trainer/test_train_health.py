"""trainer.jobs.train: non-finite steps, log lines and metrics, progress, and SageMaker's hyperparameters."""

import json
import re

import pytest

from contracts.metrics import METRIC_DEFINITIONS
from trainer.jobs import train
from trainer.runtime.health import NonFiniteLossError
from tests.trainer.train_helpers import (  # noqa: F401  (record_batches: fixtures)
    REPO_ROOT,
    json_lines,
    losses,
    record_batches,
)


# ---------------------------------------------------------------- health


def test_a_non_finite_step_is_skipped_and_training_goes_on(tmp_path, shards_dir, capsys, train_args, record_batches):
    _, loss_function = record_batches
    loss_function.nan_steps = {2}
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "3"))
    lines = json_lines(capsys.readouterr().out)
    assert [line for line in lines if line.get("event") == "skipped_step"] == [
        {"event": "skipped_step", "step": 2, "reason": "non-finite loss or gradient", "in_a_row": 1}]
    assert losses(lines)[2] is None and losses(lines)[3] is not None
    assert record["skipped_steps"] == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_repeated_non_finite_steps_end_the_job_with_a_failure_reason(tmp_path, shards_dir, monkeypatch, train_args, record_batches):
    _, loss_function = record_batches
    loss_function.always_nan = True
    monkeypatch.setenv("SM_OUTPUT_DIR", str(tmp_path / "output"))
    with pytest.raises(NonFiniteLossError):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "10", "--max-nonfinite-steps", "3",
                              "--validation-prompts", ""))
    assert (tmp_path / "output" / "failure").read_text() == (
        "NonFiniteLossError: 3 steps in a row up to step 3 had a NaN or infinite loss or gradient\n")


def test_log_lines_carry_the_metric_fields(trained, tmp_path, shards_dir, capsys, train_args):
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--resume", "none"))
    (line,) = [line for line in json_lines(capsys.readouterr().out) if "loss" in line]
    assert set(line) == {"step", "stage", "loss", "lr", "grad_norm", "img_per_s", "data_wait_share", "skipped_steps", "corrupt_samples",
                         "steps", "progress", "eta_s"}
    assert (line["steps"], line["progress"], line["eta_s"]) == (1, 1.0, 0.0)


def test_progress_is_steps_done_over_total_and_the_eta_follows_the_recent_step_rate():
    # 10 steps in the last 5 s: 2 steps/s, 70 steps left
    assert train.progress_and_eta(30, 100, 10, 5.0) == {"steps": 100, "progress": 0.3, "eta_s": 35.0}
    assert train.progress_and_eta(100, 100, 10, 5.0) == {"steps": 100, "progress": 1.0, "eta_s": 0.0}
    assert train.progress_and_eta(1, 3, 0, 0.0)["eta_s"] is None  # no steps measured yet: no rate, no guess


def test_the_metric_regexes_read_each_figure_from_a_log_line_and_not_from_other_events():
    line = json.dumps({"step": 20, "stage": 0, "lr": 1e-05, "loss": 0.123456, "grad_norm": 2.5, "img_per_s": 812.3,
                       "data_wait_share": 0.0012, "skipped_steps": 0, "corrupt_samples": 3})
    read = {definition["Name"]: re.search(definition["Regex"], line).group(1) for definition in METRIC_DEFINITIONS}
    assert {name: float(value) for name, value in read.items()} == {
        "train:loss": 0.123456, "train:lr": 1e-05, "train:grad_norm": 2.5, "train:img_per_s": 812.3,
        "train:data_wait_share": 0.0012, "train:skipped_steps": 0, "train:corrupt_samples": 3,
    }
    saved = json.dumps({"event": "saved", "model_dir": "/opt/ml/model", "steps": 20, "final_loss": 0.1})
    assert all(re.search(definition["Regex"], saved) is None for definition in METRIC_DEFINITIONS)
    docs = (REPO_ROOT / "docs" / "trainer.md").read_text()
    assert all(json.dumps(definition) in docs for definition in METRIC_DEFINITIONS)


# ---------------------------------------------------------------- arguments


def test_hyperparameters_in_sm_hps_become_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("SM_HPS", json.dumps({"batch-size": "3", "learning-rate": "0.001", "aspect-buckets": "false",
                                             "sagemaker_program": "x"}))
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "train"))
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    args = train.parse_args(["--steps", "7"])
    assert (args.batch_size, args.learning_rate, args.steps, args.aspect_buckets) == (3, 0.001, 7, False)
    assert (args.train_dir, args.model_dir) == (str(tmp_path / "train"), str(tmp_path / "model"))
    assert not hasattr(args, "sagemaker_program")
