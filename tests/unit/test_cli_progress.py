"""Progress, `--quiet` and `--json` on the long commands; what `atelier status` and `atelier models`
show of the evaluation gate (moto for the commands that reach the stack)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
from rich.console import Console

from atelier import cli, cli_deploy, client, demo
from atelier import progress as progress_module
from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from atelier.progress import progress
from contracts import pipeline_table
from core import aws
from core.deploy.candidates import consider_candidate
from core.deploy.evaluations import gate
from core.deploy.events import JobState
from core.deploy.gate import Evaluation, Scores
from core.deploy.settings import DeploySettings

RED = encode(picture("circle", "red", "blue"), "png")
LONG_COMMANDS = [("upload", "photos", "--partner", "acme"), ("demo",), ("audit",),
                 ("import", "shards/", "--partner", "acme", "--license", "CC-BY-4.0"), ("import-report", "imp-1")]


@pytest.fixture
def outputs(stack: Provisioned, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(client, "stack_outputs", lambda name: stack.outputs)
    return stack.outputs


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables and bars on one line each, whatever the terminal (they write to sys.stdout / sys.stderr)."""
    monkeypatch.setattr(cli, "console", Console(width=400))
    monkeypatch.setattr(cli_deploy, "console", Console(width=400))
    monkeypatch.setattr(progress_module, "stderr", Console(stderr=True, width=400))


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """A picture and its sidecar; upload them with `partner_a` (upload refuses a partner not registered)."""
    (tmp_path / "a.png").write_bytes(RED)
    (tmp_path / "a.json").write_text('{"caption": "a red circle"}')
    return tmp_path


# --- the bar ------------------------------------------------------------------------------------

def test_the_bar_shows_the_rate_and_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    written = io.StringIO()
    monkeypatch.setattr(progress_module, "stderr", Console(file=written, width=200))
    clock = [0.0]
    with progress() as bar:
        bar.get_time = lambda: clock[0]
        task = bar.add_task("auditing", total=10)
        for second in range(1, 5):  # one item a second
            clock[0] = float(second)
            bar.advance(task)

    line = written.getvalue()
    assert "4/10" in line and "1.0/s" in line and "eta 0:00:06" in line


def test_a_quiet_bar_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    written = io.StringIO()
    monkeypatch.setattr(progress_module, "stderr", Console(file=written, width=200))
    with progress(quiet=True) as bar:
        bar.advance(bar.add_task("auditing", total=2), 2)
    assert written.getvalue() == ""


# --- the flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", LONG_COMMANDS, ids=lambda c: c[0])
def test_each_long_command_takes_quiet_and_json_after_its_name(command: tuple[str, ...]) -> None:
    args = cli.parser().parse_args([*command, "-q", "--json"])
    assert (args.quiet, args.json) == (True, True)
    args = cli.parser().parse_args([*command, "--quiet"])
    assert (args.quiet, args.json) == (True, False)


@pytest.mark.parametrize("command", LONG_COMMANDS, ids=lambda c: c[0])
def test_the_top_level_quiet_is_kept_and_both_default_to_off(command: tuple[str, ...]) -> None:
    args = cli.parser().parse_args(["-q", *command])
    assert (args.quiet, args.json) == (True, False)
    args = cli.parser().parse_args(list(command))
    assert (args.quiet, args.json) == (False, False)


@pytest.fixture
def partner_a(outputs: dict[str, str]) -> str:
    client.add_partner(outputs, "partner-a", ["CC-BY-4.0"], [], "")
    return "partner-a"


# --- upload, audit, demo ------------------------------------------------------------------------

def test_upload_shows_its_bar_on_stderr(outputs, partner_a, photos: Path, wide, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["upload", str(photos), "--partner", "partner-a"]) == 0
    captured = capsys.readouterr()
    assert "2 files -> s3://" in captured.err and "eta" in captured.err
    assert captured.out.strip() == "2 objects uploaded for partner partner-a"


def test_upload_quiet_after_the_command_writes_no_progress(outputs, partner_a, photos: Path, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["upload", str(photos), "--partner", "partner-a", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.strip() == "2 objects uploaded for partner partner-a"


def test_upload_json_prints_one_summary_object_and_no_bar(outputs, partner_a, photos: Path, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["upload", str(photos), "--partner", "partner-a", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    listed = boto3.client("s3").list_objects_v2(Bucket=outputs["UploadsBucketName"])["Contents"]
    assert captured.err == ""
    assert {k: summary[k] for k in ("partner", "destination", "objects", "bytes")} == {
        "partner": "partner-a", "destination": f"s3://{outputs['UploadsBucketName']}/partner-a/", "objects": 2,
        "bytes": sum(o["Size"] for o in listed)}


def test_audit_quiet_writes_no_progress(outputs, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["audit", "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.strip().endswith("ok")


def test_audit_json_is_one_parseable_object_and_no_bar(outputs, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["audit", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["ok"] is True


def test_demo_json_turns_the_bar_off_and_prints_one_line_per_figure(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    given = []
    result = [{"metric": "demo.upload_to_image_s", "value": 12.5, "unit": "s", "config": {}, "commit": "abc"},
              {"metric": "demo.prompt_match_rate", "value": 0.9, "unit": "share", "config": {}, "commit": "abc"}]
    monkeypatch.setattr(demo, "run_demo", lambda options: given.append(options) or result)

    assert cli.main(["demo", "--json"]) == 0

    assert given[0].quiet is True
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == result


@pytest.mark.parametrize(("flags", "where"), [([], cli.DEMO_STATE), (["--state-dir", "elsewhere"], Path("elsewhere"))])
def test_the_demo_keeps_its_stack_where_state_dir_says_and_by_default_apart_from_local_up_s(
        monkeypatch: pytest.MonkeyPatch, flags: list[str], where: Path) -> None:
    given = []
    monkeypatch.setattr(demo, "run_demo", lambda options: given.append(options) or [])

    assert cli.main([*flags, "demo", "--json"]) == 0

    assert given[0].state_dir == where


@pytest.mark.parametrize(("flags", "grid"), [([], False), (["--grid"], True)])
def test_the_demo_draws_the_catalogue_grid_when_asked(monkeypatch: pytest.MonkeyPatch, flags: list[str], grid: bool) -> None:
    given = []
    monkeypatch.setattr(demo, "run_demo", lambda options: given.append(options) or [])

    assert cli.main(["demo", "--json", *flags]) == 0

    assert given[0].grid is grid


def test_the_kept_demo_stack_s_banner_names_its_state_in_every_command() -> None:
    state = Path("/home/someone/my atelier/.atelier/demo")

    commands = [line.strip() for line in demo.kept_stack_banner(state) if line.startswith("  ")]

    assert commands and all("--state-dir '/home/someone/my atelier/.atelier/demo'" in c for c in commands)


TRAINER_LOG = "\n".join([
    'steps": 30, "world_size": 1}',  # the tail starts inside a line
    json.dumps({"event": "start", "step": 0, "steps": 30}),
    json.dumps({"step": 10, "loss": 0.5, "img_per_s": 4.0, "steps": 30, "progress": 0.3333, "eta_s": 40.0}),
    json.dumps({"step": 20, "loss": 0.4, "img_per_s": 5.5, "steps": 30, "progress": 0.6667, "eta_s": 18.2}),
    json.dumps({"event": "checkpoint", "step": 20, "dir": "/opt/ml/checkpoints/step-00000020"}),
])


def test_the_demo_reads_the_last_training_line_of_the_job_log() -> None:
    assert demo.training_figures(TRAINER_LOG)["step"] == 20
    assert demo.training_figures(TRAINER_LOG.replace('"eta_s"', '"other"')) is None


def test_the_demo_s_training_bar_has_the_steps_the_rate_and_the_trainer_s_eta() -> None:
    stack = SimpleNamespace(sagemaker=SimpleNamespace(training_log_tail=lambda name: TRAINER_LOG))
    status = client.Status(jobs=[{"name": "atelier-enc", "role": "encode", "status": "InProgress"},
                                 {"name": "atelier-abc", "role": "train", "status": "InProgress"}])
    tasks: dict = {}
    with progress(quiet=True) as bar:
        demo._show_training(bar, stack, status, tasks)
        (task,) = [t for t in bar.tasks if t.id == tasks["atelier-abc"]]

    assert list(tasks) == ["atelier-abc"]
    assert (task.completed, task.total) == (20, 30)
    assert task.description == "training atelier-abc: 5.5 img/s, trainer's eta 18 s"


# --- the gate in `atelier status` and `atelier models` ------------------------------------------

DIGEST = "e" * 64  # the evaluation set both models were scored on


def candidate(settings: DeploySettings, name: str, ended: int) -> JobState:
    """A final-stage training job that completed, as the deploy function sees it."""
    return JobState(name=name, status="Completed", failure_reason=None, ended_at=ended,
                    model_data_url=f"s3://{settings.models_bucket}/training/{name}/output/model.tar.gz",
                    tags=(("atelier:final-stage", "true"), ("atelier:manifest", "ab" * 32)))


@pytest.fixture
def gated(outputs, function_env, wide) -> DeploySettings:
    """GIVEN atelier-first deployed (loss 0.1, CLIP 30), then atelier-second held back by the gate:
    the same loss, but a CLIP score 10 below production's (core.deploy writes both records)."""
    function_env("DeployFunction")
    settings = DeploySettings.current()
    bucket, _, prefix = settings.eval_data_uri.removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}heldout.tar", Body=bytes(1024))
    table = settings.table
    assert consider_candidate(candidate(settings, "atelier-first", 1000), settings).action == "evaluating"
    first = aws.get_item(table, pipeline_table.model_pk("atelier-first"))
    assert gate(first, Evaluation(Scores(DIGEST, 0.1, 30.0), None), settings).action == "created"
    assert consider_candidate(candidate(settings, "atelier-second", 2000), settings).action == "evaluating"
    second = aws.get_item(table, pipeline_table.model_pk("atelier-second"))
    evaluation = Evaluation(Scores(DIGEST, 0.1, 20.0), baseline=Scores(DIGEST, 0.1, 30.0))
    assert gate(second, evaluation, settings).action == "held-back"
    return settings


HELD_BACK_REASON = "CLIP score 20.00 trails production's 30.00 by more than 0.5"


def test_status_json_shows_the_decision_the_scores_and_the_reason(gated, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["status", "--json"]) == 0
    models = {m["model"]: m for m in json.loads(capsys.readouterr().out)["models"]}

    held = models["atelier-second"]
    assert (held["status"], held["decision"], held["reason"]) == ("held-back", "held-back", HELD_BACK_REASON)
    assert (held["val_loss"], held["clip_score"]) == (0.1, 20.0)
    assert (held["production_model"], held["production_val_loss"], held["production_clip_score"]) == (
        "atelier-first", 0.1, 30.0)
    assert (models["atelier-first"]["status"], models["atelier-first"]["decision"]) == ("deployed", "passed")


def test_the_status_table_shows_the_decision_the_scores_and_the_reason(gated, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out

    assert ("atelier-second: held-back; gate held-back, val loss 0.1000 vs 0.1000, CLIP 20.00 vs 30.00 "
            f"(production atelier-first) - {HELD_BACK_REASON}") in out
    assert "atelier-first: deployed; gate passed, val loss 0.1000, CLIP 30.00" in out


def test_models_json_and_table_show_the_decision_the_scores_and_the_reason(gated, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["models", "--json"]) == 0
    (held,) = [m for m in json.loads(capsys.readouterr().out) if m["model"] == "atelier-second"]
    assert (held["decision"], held["val_loss"], held["clip_score"], held["reason"]) == (
        "held-back", 0.1, 20.0, HELD_BACK_REASON)

    assert cli.main(["models"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "atelier-second" in line]
    cells = [cell.strip() for cell in row.strip().strip("│").split("│")]
    assert cells == ["atelier-second", "held-back", "held-back", "0.1000", "20.00",
                     "atelier-first (0.1000, 30.00)", HELD_BACK_REASON]
