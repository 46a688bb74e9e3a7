"""One rule for a stage's resolution: the size multiple of its model, the same in the pipeline's table
(functions/contracts/model_presets.py) as in the models the trainer builds from each preset."""

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

from contracts.model_presets import DEFAULT, SIZE_MULTIPLES
from trainer.data.phases import plan_from_args
from trainer.jobs import encode, train
from trainer.models.bundle import Models
from trainer.models.families import new_transformer
from trainer.models.loading import CONFIGS_DIR, preset_family, read_preset


def size_multiple_of(name: str) -> int:
    """`Models.size_multiple` of the preset's VAE and denoiser, built on the meta device (no weights)."""
    preset, family = read_preset(name), preset_family(name, None)
    with torch.device("meta"):
        vae = AutoencoderKL(**preset["vae"])
        denoiser = new_transformer(family, preset["transformer"]) if family else UNet2DConditionModel(**preset["unet"])
    return Models(vae=vae, text_encoders=[], tokenizers=[], denoiser=denoiser, noise_scheduler=None,
                  family=family).size_multiple


def test_the_pipeline_s_table_is_every_preset_s_size_multiple() -> None:
    presets = sorted(path.stem for path in CONFIGS_DIR.glob("*.json"))
    assert {"tiny-sd3", "tiny-flux", "tiny-pixart", "sd3-medium", "flux1", "pixart-sigma"} <= set(presets)
    assert {name: size_multiple_of(name) for name in presets} == SIZE_MULTIPLES
    from contracts.model_presets import VAE_DOWNSAMPLING  # the autoencoder job's multiple: the VAE's alone
    assert {name: 2 ** (len(read_preset(name)["vae"]["block_out_channels"]) - 1) for name in presets} == VAE_DOWNSAMPLING


def test_the_pipeline_s_default_preset_is_the_trainer_s() -> None:
    assert train.parse_args(["--train-dir", "d", "--model-dir", "m"]).model_config == DEFAULT


def test_a_phase_off_the_size_multiple_is_refused_where_the_plan_is_read() -> None:
    with pytest.raises(ValueError, match="phase 0: resolution 520 is not a multiple of 64, the model's size multiple"):
        plan_from_args(None, 10, 2, 520, 1e-4, 0, 512, size_multiple=64)
    assert plan_from_args(None, 10, 2, 512, 1e-4, 0, 512, size_multiple=64).phases[0].resolution == 512


@pytest.mark.parametrize("job", ["train", "encode"])
def test_a_job_off_the_size_multiple_stops_before_it_reads_any_shard(job: str, tmp_path, train_args) -> None:
    # GIVEN a resolution that is not a multiple of the tiny preset's 8, and a channel with no shards in it
    (tmp_path / "train").mkdir()
    if job == "train":
        args = train_args(tmp_path / "train", tmp_path / "model", tmp_path / "ckpt", "--resolution", "36")
        run = train.main
    else:
        args = encode.parse_args(["--train-dir", str(tmp_path / "train"), "--output-dir", str(tmp_path / "latents"),
                                  "--resolution", "36", "--num-workers", "0"])
        run = encode.main
    # THEN the job stops on the resolution, not on the missing shards it would have read first
    with pytest.raises(ValueError, match="resolution 36 is not a multiple of 8, the model's size multiple"):
        run(args)


def test_the_geometry_read_from_a_preset_s_configs_is_its_models_the_table_s() -> None:
    from contracts.model_presets import SIZE_MULTIPLES
    from trainer.models.loading import preset_geometry

    assert {name: preset_geometry(name)[0] for name in SIZE_MULTIPLES} == SIZE_MULTIPLES


def test_the_pipeline_s_family_and_position_tables_are_the_presets() -> None:
    from contracts.model_presets import FAMILIES, POSITION_COVER, position_refusal
    from trainer.models.loading import preset_geometry

    presets = sorted(path.stem for path in CONFIGS_DIR.glob("*.json"))
    assert {name: read_preset(name).get("family", "unet") for name in presets} == FAMILIES
    covers = {}
    for name in presets:
        preset = read_preset(name)
        table = preset.get("transformer", {}).get("pos_embed_max_size")
        if table is not None:  # SD3's table, in pixels: patches x patch x the VAE's downsampling
            vae_scale = 2 ** (len(preset["vae"]["block_out_channels"]) - 1)
            covers[name] = table * preset["transformer"]["patch_size"] * vae_scale
    assert covers == POSITION_COVER
    for name in POSITION_COVER:  # a preset trains at its own size with aspect buckets
        assert position_refusal(name, preset_geometry(name)[1], True) is None


def test_the_pipeline_s_prediction_types_are_the_unet_presets_schedules() -> None:
    from contracts.model_presets import FAMILIES, PREDICTION_TYPES

    unets = [name for name, family in FAMILIES.items() if family == "unet"]
    assert {name: read_preset(name)["scheduler"]["prediction_type"] for name in unets} == PREDICTION_TYPES


@pytest.mark.parametrize("name, billions", [("sd3-medium", 2.03), ("flux1", 11.9), ("pixart-sigma", 0.61)])
def test_a_full_size_preset_has_its_model_s_parameter_count(name: str, billions: float) -> None:
    """The layouts the presets copy (SD3-medium, FLUX.1, PixArt-Sigma), counted on the meta device (no weights)."""
    preset, family = read_preset(name), preset_family(name, None)
    with torch.device("meta"):
        transformer = new_transformer(family, preset["transformer"])
    assert sum(p.numel() for p in transformer.parameters()) / 1e9 == pytest.approx(billions, rel=0.01)
