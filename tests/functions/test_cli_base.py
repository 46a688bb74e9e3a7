"""`atelier base add DIR` against moto with the template's buckets: what it uploads, the
atelier-base.json it writes, what it refuses, and that its URI is a PretrainedModelUri the pipeline takes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from atelier import cli
from atelier.local.provision import Provisioned
from core.start_training.pretrained import check_uri, describe_base
from tests.functions.test_audit import register_outputs

FILES = {"model_index.json": b'{"_class_name": "StableDiffusionPipeline"}', "vae/config.json": b'{"latent_channels": 4}',
         "vae/diffusion_pytorch_model.safetensors": bytes(range(256)) * 64,
         "scheduler/scheduler_config.json": b'{"num_train_timesteps": 1000}',
         "text_encoder/model.safetensors": b"no config beside it: not a component"}


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    register_outputs(module_stack)  # the CLI finds the models bucket in the stack's outputs
    return module_stack


@pytest.fixture
def models(stack: Provisioned) -> Iterator[str]:
    bucket = stack.outputs["ModelsBucketName"]
    yield bucket
    s3 = boto3.client("s3")
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for version in page.get("Versions", []) + page.get("DeleteMarkers", []):
            s3.delete_object(Bucket=bucket, Key=version["Key"], VersionId=version["VersionId"])


def pipeline(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, body in {**files, ".cache/huggingface/lock": b"hidden"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return root


def stored(bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k.removeprefix(prefix): s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_base_add_uploads_the_folder_and_prints_the_parameter(models: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    root = pipeline(tmp_path / "sd2-base")

    assert cli.main(["-q", "base", "add", str(root)]) == 0

    uri = f"s3://{models}/bases/sd2-base/"
    assert capsys.readouterr().out.splitlines() == [uri, f"PretrainedModelUri={uri}"]
    files = stored(models, "bases/sd2-base/")
    assert {k: v for k, v in files.items() if k != "atelier-base.json"} == FILES  # hidden files stay home
    # AND the pipeline takes the URI: a prefix with a VAE
    base = describe_base(check_uri(uri))
    assert (base.kind, base.objects, base.has_vae) == ("prefix", len(FILES) + 1, True)


def test_atelier_base_json_lists_the_components_and_every_file(models: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = pipeline(tmp_path / "folder")

    assert cli.main(["-q", "base", "add", str(root), "--name", "sd2"]) == 0

    record = json.loads(stored(models, "bases/sd2/")["atelier-base.json"])
    assert record == {
        "schema_version": 1, "name": "sd2", "uri": f"s3://{models}/bases/sd2/", "components": ["vae", "scheduler"],
        "model_index": True,
        "files": [{"path": path, "size": len(FILES[path]), "sha256": hashlib.sha256(FILES[path]).hexdigest()}
                  for path in sorted(FILES)]}


def test_json_output_names_the_uri_and_the_parameter(models: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["base", "add", str(pipeline(tmp_path / "sd2")), "--json"]) == 0

    assert json.loads(capsys.readouterr().out) == {
        "uri": f"s3://{models}/bases/sd2/", "parameter": f"PretrainedModelUri=s3://{models}/bases/sd2/",
        "uploaded": True, "components": ["vae", "scheduler"], "files": len(FILES),
        "bytes": sum(len(b) for b in FILES.values())}


def test_a_folder_that_is_no_pipeline_is_refused_in_one_line(models: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    root = pipeline(tmp_path / "weights", {"unet/diffusion_pytorch_model.safetensors": b"weights", "notes.txt": b"hi"})

    assert cli.main(["base", "add", str(root)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"error: {root} is not a diffusers pipeline or part of one: no vae, text_encoder, tokenizer, text_encoder_2, "
        "tokenizer_2, scheduler, unet folder with its config (e.g. vae/config.json, scheduler/scheduler_config.json)"]
    assert stored(models, "bases/") == {}


def test_a_missing_folder_or_a_bad_name_is_refused(models: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["base", "add", str(tmp_path / "nowhere")]) == 2
    assert cli.main(["base", "add", str(pipeline(tmp_path / "sd2")), "--name", "sd 2"]) == 2

    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'nowhere'} is not a folder",
        "error: base name 'sd 2' must be letters, digits, '.', '_' and '-' (pass --name)"]
    assert stored(models, "bases/") == {}


def test_the_same_base_again_uploads_nothing_and_another_under_its_name_is_refused(
        models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = pipeline(tmp_path / "sd2")
    assert cli.main(["-q", "base", "add", str(root)]) == 0
    before = boto3.client("s3").head_object(Bucket=models, Key="bases/sd2/vae/config.json")["LastModified"]

    assert cli.main(["-q", "base", "add", str(root)]) == 0
    assert "(already uploaded)" in capsys.readouterr().err
    assert boto3.client("s3").head_object(Bucket=models, Key="bases/sd2/vae/config.json")["LastModified"] == before

    (root / "vae" / "config.json").write_bytes(b'{"latent_channels": 16}')
    assert cli.main(["-q", "base", "add", str(root)]) == 2
    assert "holds another base" in capsys.readouterr().err
    assert stored(models, "bases/sd2/")["vae/config.json"] == FILES["vae/config.json"]


def test_an_upload_that_did_not_finish_is_completed_and_its_leftovers_removed(models: str, tmp_path: Path) -> None:
    boto3.client("s3").put_object(Bucket=models, Key="bases/sd2/unet/stale.safetensors", Body=b"from another folder")

    assert cli.main(["-q", "base", "add", str(pipeline(tmp_path / "sd2"))]) == 0

    assert sorted(stored(models, "bases/sd2/")) == sorted([*FILES, "atelier-base.json"])
