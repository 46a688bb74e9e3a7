"""`atelier local up --base DIR --parameter NAME=VALUE`: a base and parameters for the local stack."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from atelier import cli
from atelier.local.stack import LOCAL_BASES_BUCKET, LocalStack, StackOptions
from tests.support import REPO

pytestmark = pytest.mark.e2e


def tiny_base(folder: Path) -> Path:
    """A pipeline's scheduler and VAE configs: enough for `atelier base add` to call it a base."""
    (folder / "scheduler").mkdir(parents=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDPMScheduler"}))
    (folder / "vae").mkdir()
    (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    return folder


def test_a_base_folder_and_a_parameter_reach_every_job_s_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_base(tmp_path / "my-base")
    options = StackOptions(root=REPO, state_dir=tmp_path / "stack", moto_port=0, sagemaker_port=0,
                           overrides={"TrainingQuota": "3"}, base=base)
    with LocalStack(options) as stack:
        environment = stack.provisioned.functions["StartTrainingFunction"].environment
        uri = f"s3://{LOCAL_BASES_BUCKET}/bases/my-base/"
        assert (environment["TRAINING_PRETRAINED_MODEL_URI"], environment["TRAINING_QUOTA"]) == (uri, "3")
        for key, value in stack.env.items():
            monkeypatch.setenv(key, value)
        keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=LOCAL_BASES_BUCKET)["Contents"])
        assert keys == ["bases/my-base/atelier-base.json", "bases/my-base/scheduler/scheduler_config.json",
                        "bases/my-base/vae/config.json"]


def test_a_bad_parameter_or_base_is_one_sentence_and_exit_2(tmp_path: Path, capsys) -> None:
    state = ["--state-dir", str(tmp_path / "stack")]
    assert cli.main([*state, "local", "up", "--port", "0", "--parameter", "NoSuchParameter=1"]) == 2
    assert "unknown parameters: ['NoSuchParameter']" in capsys.readouterr().err
    assert cli.main([*state, "local", "up", "--port", "0", "--base", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main([*state, "local", "up", "--parameter", "no-equals"])
    assert exit_.value.code == 2 and "is not NAME=VALUE" in capsys.readouterr().err
