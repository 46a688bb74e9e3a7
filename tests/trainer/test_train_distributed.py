"""trainer.jobs.train in several processes (DDP, FSDP) and with the VAE encoder compiled."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import PixArtTransformer2DModel, UNet2DConditionModel

from trainer.jobs import train
from trainer.jobs.encode import encode_shards
from trainer.models import text_tokenizers
from trainer.models.loading import load_models
from trainer.speed.vae_compile import compile_vae_encoder
from tests.trainer.train_helpers import REPO_ROOT, events, json_lines, losses


# ---------------------------------------------------------------- several processes


def torchrun(tmp_path: Path, shards_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "trainer.jobs.train",
        "--train-dir", str(shards_dir), "--model-dir", str(tmp_path / "model"),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
        "--batch-size", "2", "--resolution", "32", "--num-workers", "0", "--log-every", "1",
        "--validation-prompts", "a dog", "--validation-seeds", "0", "--validation-inference-steps", "2", *extra,
    ]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)  # two processes on a loaded 2-core CI machine


def test_two_processes_train_with_ddp_and_a_checkpoint_resumes_with_fsdp_and_with_one_process(
        tmp_path, shards_dir, capsys, train_args):
    # GIVEN two CPU processes under torchrun (gloo, DDP), one shard each
    result = torchrun(tmp_path, shards_dir, "--steps", "2")
    # THEN one log, one checkpoint holding both ranks' RNG, and both shards in the record
    assert result.returncode == 0, result.stderr[-3000:]
    lines = json_lines(result.stdout)
    assert list(losses(lines)) == [1, 2]
    start = next(line for line in lines if line.get("event") == "start")
    assert (start["world_size"], start["backend"], start["strategy"]) == (2, "gloo", "ddp")
    assert list(start["preflight"]) == ["all_reduce_s"]  # the preflight's all-reduce ran over both processes
    checkpoint = tmp_path / "ckpt" / "step-00000002"
    assert sorted(path.name for path in checkpoint.iterdir()) == ["ema_unet", "manifest.json", "rng-rank0.pt", "rng-rank1.pt", "training_state.pt", "unet"]
    assert {"rng-rank0.pt", "rng-rank1.pt"} <= {entry["path"] for entry in json.loads((checkpoint / "manifest.json").read_text())["files"]}
    rng = [torch.load(checkpoint / f"rng-rank{rank}.pt", weights_only=False)["torch"] for rank in (0, 1)]
    assert not torch.equal(*rng)  # each rank draws its own noise
    record = json.loads((tmp_path / "model" / "atelier-training.json").read_text())
    assert record["shards_seen"] == ["shard-a.tar", "shard-b.tar"]
    # WHEN the checkpoint is resumed by two FSDP processes
    result = torchrun(tmp_path, shards_dir, "--steps", "3", "--strategy", "fsdp")
    # THEN they continue at step 3 with sharded weights and write a checkpoint that loads as a UNet
    assert result.returncode == 0, result.stderr[-3000:]
    lines = json_lines(result.stdout)
    assert events(lines)["resumed"]["step"] == 2 and list(losses(lines)) == [3]
    UNet2DConditionModel.from_pretrained(tmp_path / "ckpt" / "step-00000003" / "unet")
    # WHEN that checkpoint is resumed by a single process
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "4"))
    # THEN it continues at step 4
    assert list(losses(json_lines(capsys.readouterr().out))) == [4]


def test_two_fsdp_processes_train_a_transformer_family_and_save_its_checkpoint(tmp_path, shards_dir):
    result = torchrun(tmp_path, shards_dir, "--steps", "2", "--strategy", "fsdp", "--model-config", "tiny-pixart")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(losses(json_lines(result.stdout))) == [1, 2]
    PixArtTransformer2DModel.from_pretrained(tmp_path / "ckpt" / "step-00000002" / "unet")


@pytest.mark.parametrize("kind", ["image", "latent"])
def test_compile_compiles_the_vae_encoder_on_image_shards_only(kind, tmp_path, shards_dir, monkeypatch, train_args):
    """--compile: the UNet step, and the VAE encoder where it runs every step (image shards); the run still saves."""
    compiled, real_compile = [], torch.compile

    def compile_unet(model, **options):  # the UNet stays eager (inductor on a CPU needs minutes); the rest is real
        if not isinstance(model, torch.nn.Module):
            return real_compile(model, **options)
        compiled.append(type(model).__name__)
        return model

    monkeypatch.setattr(torch, "compile", compile_unet)

    def recording(models, channels_last=False, backend="inductor"):
        compiled.append("vae encoder")
        compile_vae_encoder(models, channels_last, backend="aot_eager")  # traced for real; no C++ compiler needed

    monkeypatch.setattr(train, "compile_vae_encoder", recording)
    train_dir, tokenizer = shards_dir, []
    if kind == "latent":  # encoded with tokenizers learned from no captions, which the run then takes as --tokenizer
        models = load_models("tiny", None, seed=0)
        train_dir = encode_shards(shards_dir, tmp_path / "latents", models, 32, torch.device("cpu"), batch_size=2,
                                  num_workers=0)["dir"]
        text_tokenizers.save({"tokenizer": models.tokenizers[0]}, tmp_path / "tokenizer")
        tokenizer = ["--tokenizer", str(tmp_path / "tokenizer")]
    args = train_args(train_dir, tmp_path / "model", tmp_path / "checkpoints", "--steps", "1", "--compile", "true",
                      *tokenizer)
    train.main(args)

    assert compiled == (["UNet2DConditionModel", "vae encoder"] if kind == "image" else ["UNet2DConditionModel"])
    assert (tmp_path / "model" / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    torch._dynamo.reset()
