"""bench/grid_ceiling.py: real catalogue pictures, scored as drawn and after a VAE's round trip."""

import json
import sys

import torch
from diffusers import AutoencoderKL

from bench import grid_ceiling
from trainer.models.loading import read_preset


def test_drawn_pictures_all_read_right_and_an_untrained_vae_loses_them(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    AutoencoderKL(**read_preset("demo")["vae"]).save_pretrained(tmp_path / "vae")
    monkeypatch.setattr(sys, "argv", ["grid_ceiling.py", "--vae", str(tmp_path / "vae"), "--variants", "1"])
    before = torch.get_num_threads()
    try:
        grid_ceiling.main()
    finally:
        torch.set_num_threads(before)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["metric"] == "demo.grid_ceiling" and line["pictures"] == 90
    assert line["raw"] == 1.0  # the classifier reads every drawn catalogue picture right at 32 px
    assert line["value"] < 0.1 and sum(line["misses"].values()) == round((1 - line["value"]) * 90)
