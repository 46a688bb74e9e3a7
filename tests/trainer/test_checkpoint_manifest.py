"""trainer.runtime.checkpoints: a checkpoint counts only when its manifest verifies (SageMaker uploads file by file)."""

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.jobs import train
from trainer.runtime.checkpoints import MANIFEST_NAME, WEIGHTS_NAME, CheckpointError, checkpoint_to_resume, prune_checkpoints

STEPS = ["--steps", "4", "--checkpoint-every", "2"]


SETUP_EVENTS = ("imported", "models")  # every job logs these first: its imports and its models are done


def json_lines(text: str) -> list[dict]:
    """The job's log lines after its setup events."""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") not in SETUP_EVENTS]


def losses(lines: list[dict]) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def loss_curve(record: dict) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in record["history"]]


def step_names(checkpoint_dir: Path) -> list[str]:
    return sorted(path.name for path in checkpoint_dir.iterdir() if path.name.startswith(("step-", ".tmp-step-")))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shards_dir, train_args) -> dict:
    """An uninterrupted run of 4 steps, checkpointed at steps 2 and 4: its checkpoints, logs and record."""
    root = tmp_path_factory.mktemp("straight")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        record = train.main(train_args(shards_dir, root / "model", root / "checkpoints", *STEPS))
    state = torch.load(root / "checkpoints" / "step-00000004" / "training_state.pt", weights_only=False)
    return {"checkpoint_dir": root / "checkpoints", "model_dir": root / "model", "record": record,
            "losses": losses(json_lines(out.getvalue())), "loss_history": state["loss_history"]}


@pytest.fixture
def checkpoint_dir(straight, tmp_path) -> Path:
    """A copy of the uninterrupted run's checkpoints (steps 2 and 4, both complete) to damage."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(straight["checkpoint_dir"], copy)
    return copy


# Damage as a cut-off upload or an interrupted restore leaves it; each returns the reason to expect.

def truncate_unet_weights(step_dir: Path) -> str:
    weights = step_dir / "unet" / WEIGHTS_NAME
    full = weights.stat().st_size
    with weights.open("r+b") as stream:
        stream.truncate(full // 2)
    return f"size mismatch unet/{WEIGHTS_NAME}: {full // 2} bytes, manifest says {full}"


def delete_training_state(step_dir: Path) -> str:
    (step_dir / "training_state.pt").unlink()
    return "missing training_state.pt"


def delete_manifest(step_dir: Path) -> str:
    (step_dir / MANIFEST_NAME).unlink()
    return "no manifest"


def flip_a_byte_of_training_state(step_dir: Path) -> str:
    path = step_dir / "training_state.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return "sha256 mismatch training_state.pt"


DAMAGES = [truncate_unet_weights, delete_training_state, delete_manifest]


def broken_copy(checkpoint_dir: Path, source: str, name: str, damage) -> str:
    """`name`: a copy of the complete checkpoint `source`, damaged; the reason it will be skipped."""
    shutil.copytree(checkpoint_dir / source, checkpoint_dir / name)
    return damage(checkpoint_dir / name)


# ---------------------------------------------------------------- the manifest


def test_the_manifest_lists_every_file_of_the_checkpoint_with_its_size_and_sha256(straight):
    step_dir = straight["checkpoint_dir"] / "step-00000004"
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    on_disk = [{"path": path.relative_to(step_dir).as_posix(), "size": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
               for path in sorted(step_dir.rglob("*")) if path.is_file() and path.name != MANIFEST_NAME]
    assert manifest == {"format": 1, "step": 4, "files": on_disk}
    assert [entry["path"] for entry in on_disk] == [
        "ema_unet/config.json", f"ema_unet/{WEIGHTS_NAME}", "rng-rank0.pt", "training_state.pt",
        "unet/config.json", f"unet/{WEIGHTS_NAME}",
    ]


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda damage: damage.__name__)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_repeats_the_uninterrupted_losses(
        damage, straight, checkpoint_dir, tmp_path, shards_dir, capsys, train_args):
    # GIVEN the uninterrupted run's checkpoints with the newest (step 4, which `latest` names) damaged
    reason = damage(checkpoint_dir / "step-00000004")
    assert (checkpoint_dir / "latest").read_text() == "step-00000004"
    # WHEN the run is started again for the same 4 steps
    record = train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, *STEPS))
    lines = json_lines(capsys.readouterr().out)
    # THEN it names the checkpoint it skipped and why, and resumes from step 2
    assert lines[:2] == [
        {"event": "checkpoint_skipped", "checkpoint": str(checkpoint_dir / "step-00000004"), "reason": reason},
        {"event": "resumed", "checkpoint": str(checkpoint_dir / "step-00000002"), "step": 2, "stage": 0},
    ]
    # and steps 3 and 4 have the uninterrupted run's losses, exactly, as has the whole history
    assert losses(lines) == {3: straight["losses"][3], 4: straight["losses"][4]}
    assert loss_curve(record) == loss_curve(straight["record"])
    # and step 4 is written again, complete, with the uninterrupted loss history and weights
    assert checkpoint_to_resume("latest", checkpoint_dir) == checkpoint_dir / "step-00000004"
    state = torch.load(checkpoint_dir / "step-00000004" / "training_state.pt", weights_only=False)
    assert state["loss_history"] == straight["loss_history"]
    resumed, uninterrupted = load_file(tmp_path / "model" / "unet" / WEIGHTS_NAME), load_file(straight["model_dir"] / "unet" / WEIGHTS_NAME)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(value, uninterrupted[name]) for name, value in resumed.items())


def test_latest_naming_a_broken_checkpoint_is_ignored_for_the_newest_verified_one(checkpoint_dir, capsys):
    # GIVEN complete checkpoints at steps 2 and 4, a step 6 whose bytes differ from its manifest, and `latest` naming step 6
    reason = broken_copy(checkpoint_dir, "step-00000004", "step-00000006", flip_a_byte_of_training_state)
    (checkpoint_dir / "latest").write_text("step-00000006")
    # WHEN the checkpoint to resume is chosen
    chosen = checkpoint_to_resume("latest", checkpoint_dir)
    # THEN it is step 4, and one line says step 6 was skipped and why
    assert chosen == checkpoint_dir / "step-00000004"
    assert json_lines(capsys.readouterr().out) == [
        {"event": "checkpoint_skipped", "checkpoint": str(checkpoint_dir / "step-00000006"), "reason": reason},
    ]


def test_latest_naming_an_older_checkpoint_does_not_hold_resume_back(checkpoint_dir, capsys):
    (checkpoint_dir / "latest").write_text("step-00000002")
    assert checkpoint_to_resume("latest", checkpoint_dir) == checkpoint_dir / "step-00000004"
    assert json_lines(capsys.readouterr().out) == []


def test_an_unfinished_tmp_step_directory_is_never_resumed_and_is_pruned(checkpoint_dir, capsys):
    # GIVEN a `.tmp-step-…` directory newer than any checkpoint, even one whose manifest verifies
    shutil.copytree(checkpoint_dir / "step-00000004", checkpoint_dir / ".tmp-step-00000006")
    # THEN resume takes step 4 without a word about it, and pruning removes it
    assert checkpoint_to_resume("latest", checkpoint_dir) == checkpoint_dir / "step-00000004"
    assert json_lines(capsys.readouterr().out) == []
    prune_checkpoints(checkpoint_dir, keep=2)
    assert step_names(checkpoint_dir) == ["step-00000002", "step-00000004"]


def test_no_verified_checkpoint_starts_over(checkpoint_dir, capsys):
    # GIVEN only checkpoints without manifests (as the trainer wrote them before manifests existed)
    delete_manifest(checkpoint_dir / "step-00000002")
    delete_manifest(checkpoint_dir / "step-00000004")
    # THEN there is nothing to resume, and both are named as skipped
    assert checkpoint_to_resume("latest", checkpoint_dir) is None
    assert json_lines(capsys.readouterr().out) == [
        {"event": "checkpoint_skipped", "checkpoint": str(checkpoint_dir / name), "reason": "no manifest"}
        for name in ("step-00000004", "step-00000002")
    ]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda damage: damage.__name__)
def test_an_explicit_resume_of_a_broken_checkpoint_fails_before_training(
        damage, checkpoint_dir, tmp_path, shards_dir, capsys, train_args):
    # GIVEN a damaged checkpoint named by --resume
    named = checkpoint_dir / "step-00000004"
    reason = damage(named)
    # WHEN the run starts
    with pytest.raises(CheckpointError) as raised:
        train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, *STEPS, "--resume", str(named)))
    # THEN it stops with the checkpoint and the reason, before reading data or training a step
    assert str(raised.value) == f"--resume {named}: {reason}"
    assert json_lines(capsys.readouterr().out) == []
    assert not (tmp_path / "model").exists()


def test_an_explicit_resume_of_a_missing_directory_fails(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint_to_resume(str(tmp_path / "step-00000009"), tmp_path)


# ---------------------------------------------------------------- pruning


def test_pruning_keeps_the_newest_verified_checkpoint_when_newer_ones_are_broken(checkpoint_dir):
    # GIVEN complete checkpoints at steps 2 and 4, broken ones after them (6, 8) and an older broken one (1)
    broken_copy(checkpoint_dir, "step-00000004", "step-00000006", truncate_unet_weights)
    broken_copy(checkpoint_dir, "step-00000004", "step-00000008", delete_manifest)
    broken_copy(checkpoint_dir, "step-00000002", "step-00000001", delete_training_state)
    # WHEN only the newest two are to be kept
    prune_checkpoints(checkpoint_dir, keep=2)
    # THEN those two stay, and so does step 4, the newest one that verifies; the older ones go
    assert step_names(checkpoint_dir) == ["step-00000004", "step-00000006", "step-00000008"]
    assert checkpoint_to_resume("latest", checkpoint_dir) == checkpoint_dir / "step-00000004"


def test_a_run_keeping_one_checkpoint_keeps_the_one_it_wrote_when_a_newer_one_is_broken(
        checkpoint_dir, tmp_path, shards_dir, train_args):
    # GIVEN the newest checkpoint (step 4) broken, so a run resumes from step 2
    delete_training_state(checkpoint_dir / "step-00000004")
    # WHEN it checkpoints step 3 and keeps one checkpoint
    train.main(train_args(shards_dir, tmp_path / "model", checkpoint_dir, "--steps", "3", "--checkpoint-every", "3",
                          "--keep-checkpoints", "1"))
    # THEN step 3, the newest that verifies, is kept beside the newest (broken) one
    assert step_names(checkpoint_dir) == ["step-00000003", "step-00000004"]
    assert checkpoint_to_resume("latest", checkpoint_dir) == checkpoint_dir / "step-00000003"
