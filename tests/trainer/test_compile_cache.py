"""trainer.speed.compile_cache and --compile auto: compile once per shape, fall back on a bad cache, default from configs/defaults/fast.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.jobs import train
from trainer.speed import compile_cache, fast_defaults
from trainer.speed.compile_cache import CacheKey, JobCache

pytestmark = pytest.mark.slow(seconds=55)
REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = CacheKey("2.13.0+cpu", "cpu", "abc123", "latent", 32, 2, False, 1)

# One process of a job: load the shape's file, compile a small model with Inductor, take a training
# step, save. Each process has its own Inductor directory, so only the cache file can carry a compile.
JOB = """
import json, sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from trainer.speed.compile_cache import CacheKey, JobCache
cache = JobCache(Path(sys.argv[1]), [CacheKey(*json.loads(sys.argv[2]))], rank=0, environ={})
loaded = cache.load()
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)), dynamic=False)
model(torch.randn(8, 16)).sum().backward()
saved = cache.save(0)
print(json.dumps({"loaded": loaded, "saved": saved, "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "fx_misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run_job(cache_dir: Path, inductor_dir: Path, key: CacheKey = KEY) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", JOB, str(cache_dir), json.dumps(list(vars(key).values()))],
                          capture_output=True, text=True, env=env, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_job_compiles_from_the_first_jobs_cache_file(tmp_path):
    # GIVEN a first job that compiled its shape cold and saved the shape's file
    cold = run_job(tmp_path / "cache", tmp_path / "inductor-1")
    assert cold["loaded"]["missing"] == [KEY.file_name] and cold["fx_hits"] == 0 and cold["fx_misses"] > 0
    assert cold["saved"]["bytes"] > 0 and (tmp_path / "cache" / KEY.file_name).is_file()
    # WHEN a second job, on a machine with an empty Inductor directory, starts with that file
    warm = run_job(tmp_path / "cache", tmp_path / "inductor-2")
    # THEN its graphs come from the file, none compiled again
    assert warm["loaded"]["loaded"] == [KEY.file_name]
    assert warm["fx_hits"] == cold["fx_misses"] and warm["fx_misses"] == 0


def test_a_corrupt_or_truncated_file_falls_back_to_compiling(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / KEY.file_name).write_bytes(b"\x00 not a cache" * 100)
    outcome = JobCache(tmp_path / "cache", [KEY], rank=0, environ={}).load()
    assert outcome["loaded"] == [] and KEY.file_name in outcome["unusable"]
    # a job on it still compiles, and replaces the bad file with a good one
    job = run_job(tmp_path / "cache", tmp_path / "inductor")
    assert job["loaded"]["unusable"] and job["fx_misses"] > 0 and job["saved"]["bytes"] > 0
    assert JobCache(tmp_path / "cache", [KEY], rank=0, environ={}).load()["loaded"] == [KEY.file_name]


def test_files_are_found_in_the_checkpoints_then_the_shared_channel_and_written_to_the_checkpoints(tmp_path):
    channel, own = tmp_path / "channel", tmp_path / "ckpt" / "compile-cache"
    channel.mkdir()
    (channel / KEY.file_name).write_bytes(b"garbage")
    cache = JobCache(own, [KEY], rank=0, environ={compile_cache.CHANNEL_ENV: str(channel)})
    assert cache.dirs == [own, channel]
    assert list(cache.load()["unusable"]) == [KEY.file_name]  # the channel's file was the one read
    assert JobCache(own, [KEY], rank=1, environ={}).save(0) is None  # only rank 0 writes


def test_each_shape_has_its_own_file_name():
    names = {KEY.file_name}
    for change in ({"torch_version": "2.11.0+cu130"}, {"device": "NVIDIA H200"}, {"unet": "def456"}, {"source": "image"},
                   {"resolution": 64}, {"batch": 4}, {"channels_last": True}, {"world_size": 8}):
        names.add(CacheKey(**{**vars(KEY), **change}).file_name)
    assert len(names) == 9
    assert CacheKey(**{**vars(KEY), "device": "NVIDIA H200"}).file_name.startswith("torch2.13.0-nvidia-h200-")


def test_the_compile_mode_and_an_adapter_name_their_own_files():
    """Regional graphs and peft's layers are other graphs than the whole model's: no file of one loads as another."""
    from trainer.models import lora
    from trainer.models.loading import load_models
    denoiser, cpu = load_models("tiny-sd3", None, seed=0).denoiser, torch.device("cpu")
    whole = compile_cache.cache_key(denoiser, cpu, "latent", 32, 2, False, 1)
    regional = compile_cache.cache_key(denoiser, cpu, "latent", 32, 2, False, 1, "regional")
    lora.add_adapter(denoiser, lora.config_for("sd3", rank=4, alpha=8), seed=0, frozen=torch.float32)
    adapted = compile_cache.cache_key(denoiser, cpu, "latent", 32, 2, False, 1, "regional")
    assert whole.file_name.endswith(f"-latent-r32-b2-w1{compile_cache.SUFFIX}")  # the name such files had before
    assert regional.file_name == whole.file_name.replace(compile_cache.SUFFIX, f"-regional{compile_cache.SUFFIX}")
    assert adapted.file_name == whole.file_name.replace(compile_cache.SUFFIX,
                                                        f"-regional-lora-r4a8{compile_cache.SUFFIX}")


def test_the_architecture_digest_ignores_bookkeeping_keys_only():
    config = {"block_out_channels": [32, 64], "_name_or_path": "/opt/ml/input/data/pretrained/unet", "_diffusers_version": "0.1"}
    assert compile_cache.architecture_digest(config) == compile_cache.architecture_digest({"block_out_channels": [32, 64]})
    assert compile_cache.architecture_digest(config) != compile_cache.architecture_digest({"block_out_channels": [32, 128]})


def test_first_step_of_a_stage_is_true_once_per_stage():
    cache = JobCache(None, [KEY, KEY], rank=0, environ={})
    assert [cache.first_step_of(stage) for stage in (0, 0, 1, 1, 0)] == [True, False, True, False, False]
    assert cache.save(0) is None  # no directory: nothing written


def test_compile_auto_follows_the_table_on_a_gpu_only():
    assert fast_defaults.compile_by_default("sd2", [512], on_gpu=True)
    assert fast_defaults.compile_by_default("sd2", [256, 512], on_gpu=True)
    assert not fast_defaults.compile_by_default("sd2", [512], on_gpu=False)  # Inductor on a CPU: minutes for nothing
    assert not fast_defaults.compile_by_default("sd2", [512, 1024], on_gpu=True)  # a stage the table never measured
    assert not fast_defaults.compile_by_default("tiny", [32], on_gpu=True)


def test_the_compile_option_takes_auto_true_and_false(tmp_path):
    base = ["--train-dir", str(tmp_path), "--model-dir", str(tmp_path / "m")]
    assert train.parse_args(base).compile == "auto"
    assert train.parse_args(base + ["--compile", "false"]).compile is False
    assert train.parse_args(base + ["--compile", "True"]).compile is True
    with pytest.raises(SystemExit):
        train.parse_args(base + ["--compile", "sometimes"])


def test_a_compiled_run_with_a_corrupt_cache_file_trains_and_logs_why(tmp_path, shards_dir, monkeypatch, train_args, capsys):
    """The job never fails over its cache: a bad file is logged as unusable and the run goes on."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)  # Inductor on a CPU needs minutes
    monkeypatch.setattr(train, "compile_vae_encoder", lambda models: None)
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "2", "--compile", "true")
    models = train.load_models("tiny", None, seed=0)
    key = compile_cache.cache_key(models.denoiser, torch.device("cpu"), "image", args.resolution or models.default_resolution,
                                  args.batch_size, False, 1)
    (tmp_path / "ckpt" / "compile-cache").mkdir(parents=True)
    (tmp_path / "ckpt" / "compile-cache" / key.file_name).write_bytes(b"truncated")
    train.main(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    [event] = [line for line in lines if line.get("event") == "compile_cache"]
    assert list(event["unusable"]) == [key.file_name]
    assert any(line.get("event") == "compile_cache_saved" and line["step"] == 1 for line in lines)
    assert (tmp_path / "model" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
