"""Pretrained parts in: a base (`--pretrained`) gives what it holds, `--vae` replaces its VAE,
`--init-unet` picks fine-tuning or a UNet from scratch, and a base that cannot be used fails at start."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file

from tests.support import REPO
from trainer.jobs import train
from trainer.models.loading import BaseModelError, load_models, read_preset


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(next(folder.glob("*.safetensors")))


def same(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, saved[name]) for name, value in module.state_dict().items())


@pytest.fixture
def partial_base(trained, tmp_path):
    """A saved pipeline without its UNet: a VAE, a text encoder and tokenizer, a scheduler."""
    base = tmp_path / "base"
    source = trained["model_dir"]
    top_level = {"unet", "model_index.json", "atelier-training.json", "health", "report.html"}
    shutil.copytree(source, base, ignore=lambda folder, names: [n for n in names if Path(folder) == source and n in top_level])
    return base


def test_a_base_without_a_unet_gives_its_frozen_parts_and_the_preset_s_unet(partial_base):
    models = load_models("tiny", str(partial_base), seed=7)
    assert same(models.vae, weights(partial_base / "vae"))
    assert same(models.text_encoders[0], weights(partial_base / "text_encoder"))
    assert same(models.denoiser, load_models("tiny", None, seed=7).denoiser.state_dict())  # from scratch, seeded
    assert models.sources == {"vae": f"--pretrained {partial_base}", "text_encoder": f"--pretrained {partial_base}",
                              "unet": "tiny (random)", "scheduler": f"--pretrained {partial_base}"}


def test_init_unet_chooses_between_fine_tuning_and_from_scratch(trained):
    saved = weights(trained["model_dir"] / "unet")
    assert same(load_models("tiny", str(trained["model_dir"]), seed=0).denoiser, saved)
    assert same(load_models("tiny", str(trained["model_dir"]), seed=0, init_unet="pretrained").denoiser, saved)
    assert not same(load_models("tiny", str(trained["model_dir"]), seed=0, init_unet="random").denoiser, saved)


def test_init_unet_pretrained_needs_a_unet_in_the_base(partial_base):
    with pytest.raises(BaseModelError, match="has no unet/ to fine-tune"):
        load_models("tiny", str(partial_base), seed=0, init_unet="pretrained")


def test_a_text_encoder_without_its_tokenizer_is_refused(partial_base):
    shutil.rmtree(partial_base / "tokenizer")
    with pytest.raises(BaseModelError, match="has text_encoder/ but no tokenizer/"):
        load_models("tiny", str(partial_base), seed=0)


def test_vae_replaces_the_base_s_and_comes_packed_as_the_autoencoder_job_leaves_it(trained, tmp_path, monkeypatch):
    # GIVEN an autoencoder job's model.tar.gz (the VAE at the archive's root) in a `vae` channel
    vae = AutoencoderKL.from_pretrained(trained["model_dir"] / "vae")
    with torch.no_grad():
        vae.decoder.conv_out.bias.add_(1.0)  # other weights than the base's
    vae.save_pretrained(tmp_path / "ae")
    channel = tmp_path / "channel-vae"
    channel.mkdir()
    with tarfile.open(channel / "model.tar.gz", "w:gz") as archive:
        for path in (tmp_path / "ae").iterdir():
            archive.add(path, arcname=path.name)
    monkeypatch.setenv("SM_CHANNEL_VAE", str(channel))
    models = load_models("tiny", str(trained["model_dir"]), seed=0, vae="vae")
    assert same(models.vae, weights(tmp_path / "ae")) and models.sources["vae"] == "--vae vae"


def test_a_vae_that_does_not_fit_the_unet_fails_before_any_data_is_read(tmp_path):
    config = read_preset("tiny")["vae"]
    AutoencoderKL(**{**config, "latent_channels": 8}).save_pretrained(tmp_path / "vae8")
    with pytest.raises(BaseModelError, match="the UNet takes 4 latent channels but the VAE makes 8"):
        load_models("tiny", None, seed=0, vae=str(tmp_path / "vae8"))


def test_a_missing_or_broken_base_is_a_sentence(tmp_path, monkeypatch):
    with pytest.raises(BaseModelError, match="neither a directory nor a channel"):
        load_models("tiny", str(tmp_path / "nowhere"), seed=0)
    (tmp_path / "channel").mkdir()
    (tmp_path / "channel" / "model.tar.gz").write_bytes(b"not a tarball")
    monkeypatch.setenv("SM_CHANNEL_PRETRAINED", str(tmp_path / "channel"))
    with pytest.raises(BaseModelError, match="model.tar.gz cannot be unpacked"):
        load_models("tiny", "pretrained", seed=0)
    with pytest.raises(BaseModelError, match="--vae .* holds no diffusers AutoencoderKL"):
        load_models("tiny", None, seed=0, vae=str(tmp_path))


def test_a_bad_base_fails_the_job_at_start_with_the_reason(tmp_path, shards_dir, train_args, capsys):
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--pretrained", str(tmp_path / "nowhere"))
    with pytest.raises(BaseModelError):
        train.main(args)
    assert '"event": "start"' not in capsys.readouterr().out  # nothing trained, no data read
    assert not (tmp_path / "ckpt").exists()


def test_an_unpacked_archive_is_removed_when_the_process_ends(tmp_path: Path) -> None:
    # GIVEN a channel holding a model.tar.gz
    channel = tmp_path / "channel"
    (tmp_path / "model").mkdir(parents=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    channel.mkdir()
    with tarfile.open(channel / "model.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "model" / "config.json", arcname="config.json")

    # WHEN a process unpacks it and ends
    run = subprocess.run([sys.executable, "-c", "import sys; from trainer.models.loading import channel_path; "
                          "path = channel_path(sys.argv[1]); print(path, (path / 'config.json').is_file())",
                          str(channel)], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'functions'}"})

    # THEN it was there while the process ran, and is gone after
    unpacked, present = run.stdout.split()
    assert run.returncode == 0 and present == "True", run.stderr
    assert not Path(unpacked).exists()
