"""trainer/speed/fast_defaults.py `measured_preset`: whose measured speed levers `--compile auto` and `--cuda-graphs auto`
follow. A job built from a preset follows the preset's rows of configs/defaults/fast.json; a --pretrained base follows
the rows of the preset of its architecture, whatever --model-config says."""

import json

from trainer.jobs import train
from trainer.models.loading import load_models
from trainer.models.pipelines import build_pipeline
from trainer.speed import fast_defaults
from trainer.speed.fast_defaults import CONFIGS, FastConfig, measured_preset


def denoiser_config(preset: str) -> dict:
    config = json.loads((CONFIGS / f"{preset}.json").read_text())
    return config.get("transformer") or config["unet"]


def test_a_job_built_from_a_preset_follows_that_preset_s_rows():
    assert measured_preset("sd2", "UNet2DConditionModel", {}, from_base=False) == "sd2"
    assert measured_preset("tiny", "UNet2DConditionModel", denoiser_config("sd2"), from_base=False) == "tiny"


def test_a_base_follows_the_measured_preset_of_its_architecture_not_model_config():
    # a base saved by diffusers: its config has every key, tuples where the preset has lists, its own sizes
    sd3 = {**denoiser_config("sd3-medium"), "pos_embed_max_size": 384, "qk_norm": None, "dual_attention_layers": ()}
    assert measured_preset("tiny", "SD3Transformer2DModel", sd3, from_base=True) == "sd3-medium"
    flux_dev = {**denoiser_config("flux1"), "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
    assert measured_preset("tiny", "FluxTransformer2DModel", flux_dev, from_base=True) == "flux1"
    pixart = {**denoiser_config("pixart-sigma"), "out_channels": 8}  # PixArt-Sigma's learned variance: one layer
    assert measured_preset("tiny", "PixArtTransformer2DModel", pixart, from_base=True) == "pixart-sigma"
    sd2 = {**denoiser_config("sd2"), "block_out_channels": (320, 640, 1280, 1280), "sample_size": 96}
    assert measured_preset("tiny", "UNet2DConditionModel", sd2, from_base=True) == "sd2"


def test_a_base_of_no_measured_architecture_follows_none():
    assert measured_preset("sd3-medium", "SD3Transformer2DModel", {**denoiser_config("sd3-medium"), "num_layers": 12},
                           from_base=True) is None
    # the same config under another class: PixArt-Sigma's numbers do not speak for a UNet
    assert measured_preset("tiny", "UNet2DConditionModel", denoiser_config("pixart-sigma"), from_base=True) is None
    assert measured_preset("tiny", "SD3Transformer2DModel", denoiser_config("tiny-sd3"), from_base=True) is None
    # SD3.5-medium: SD3-medium's widths, other blocks (query-key norms, dual attention), which no row measured
    sd35 = {**denoiser_config("sd3-medium"), "qk_norm": "rms_norm", "dual_attention_layers": tuple(range(13))}
    assert measured_preset("tiny", "SD3Transformer2DModel", sd35, from_base=True) is None


def test_a_pretrained_job_reads_the_table_for_its_base_s_architecture(tmp_path, shards_dir, train_args, monkeypatch,
                                                                       capsys):
    """--pretrained with --model-config left at its default (tiny): the compile decision is asked for the preset the
    base's transformer is (here tiny-sd3, given a row for the test), not for tiny, which no row measures."""
    models = load_models("tiny-sd3", None, seed=0)
    base = tmp_path / "base"
    build_pipeline(models, models.denoiser).save_pretrained(base)
    row = FastConfig("tiny-sd3", 64, compile=True, fused_adamw=True, batch_size=2, gradient_accumulation=1, measured={})
    monkeypatch.setattr(fast_defaults, "table", lambda: {("tiny-sd3", 64): row})
    asked = []
    monkeypatch.setattr(train, "compile_by_default", lambda preset, resolutions, on_gpu: asked.append(preset) or False)
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--pretrained", str(base), "--steps", "1",
                      "--resolution", "64", "--compile-cache", "none")
    assert args.model_config == "tiny"
    train.main(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert asked == ["tiny-sd3"]
    assert [line["speed_table"] for line in lines if line.get("event") == "models"] == ["tiny-sd3"]
