"""The transformer families (trainer/families.py) trained with flow matching (trainer/flow_matching.py):
presets, the objective, a run through trainer.train, the saved pipeline, evaluation and serving."""

import argparse
import http.client
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (DiffusionPipeline, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       PixArtSigmaPipeline, StableDiffusion3Pipeline)

from trainer.data.captions import read_captions
from trainer.data.eval_set import EvalSample
from trainer.jobs import train
from trainer.jobs.sampling import save_model
from trainer.jobs.scoring import flow_loss_summary, flow_validation_losses
from trainer.data.buckets import widest_side
from trainer.models.families import PIXART, check_flow_run, check_positions, condition, prepared, sampling_options
from trainer.models.loading import BaseModelError, from_pretrained, load_models
from trainer.models.pipelines import build_pipeline
from trainer.objectives import flow_matching
from trainer.objectives.diffusion import diffusion_loss
from trainer.objectives.flow_matching import FlowSettings, sample_timesteps, shifted
from trainer.objectives.numerics import step_generator
from trainer.serve.generation import check_request, generate, load_pipeline
from trainer.serve.levers import apply_levers
from trainer.serve.protocol import BadRequest, Generation
from trainer.serve.server import InferenceServer
from trainer.serve.settings import Provenance, ServeSettings

CPU = torch.device("cpu")
PROVENANCE = Provenance(model_id="atelier-0123456789abcdef0123", manifest="9f2c" * 16, attribution="s3://models/a.json")
CONFIGS = Path(__file__).resolve().parents[2] / "trainer" / "configs"
FAMILIES = [("tiny-sd3", StableDiffusion3Pipeline, FlowMatchEulerDiscreteScheduler),
            ("tiny-flux", FluxPipeline, FlowMatchEulerDiscreteScheduler),
            ("tiny-pixart", PixArtSigmaPipeline, DPMSolverMultistepScheduler)]


# ---------------------------------------------------------------- the objective


def test_the_noised_latents_run_from_the_data_to_the_noise_and_the_target_is_the_velocity():
    latents, noise = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    noisy, target = flow_matching.noised(latents, noise, torch.tensor([0.0, 0.25, 1.0]))
    assert torch.equal(noisy[0], latents[0]) and torch.equal(noisy[2], noise[2])
    assert torch.allclose(noisy[1], 0.75 * latents[1] + 0.25 * noise[1])
    assert torch.equal(target, noise - latents)


def test_the_shift_pushes_timesteps_to_noise_in_proportion_to_the_side():
    settings = FlowSettings(shift_at_reference=1.0, reference_resolution=256)
    assert [settings.shift(side) for side in (256, 512, 1024)] == [1.0, 2.0, 4.0]
    t = torch.linspace(0, 1, 11)
    assert torch.equal(shifted(t, 1.0), t)
    pushed = shifted(t, 3.0)
    assert pushed[0] == 0 and pushed[-1] == 1 and torch.all(pushed[1:-1] > t[1:-1])
    assert torch.isclose(shifted(torch.tensor(0.5), 3.0), torch.tensor(0.75))  # 3 * 0.5 / (1 + 2 * 0.5)


def test_training_timesteps_are_logit_normal_from_the_step_generator():
    settings = FlowSettings()
    draw = lambda seed: sample_timesteps(settings, 4000, 256, CPU, torch.Generator().manual_seed(seed))
    first, again, other = draw(1), draw(1), draw(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert 0 < first.min() and first.max() < 1
    assert abs(first.median().item() - 0.5) < 0.03  # sigmoid(N(0, 1)) is symmetric about 1/2
    assert abs(torch.logit(first).std().item() - 1.0) < 0.05
    assert sample_timesteps(settings, 4000, 1024, CPU, torch.Generator().manual_seed(1)).median() > 0.75


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux", "tiny-pixart"])
def test_the_flow_loss_trains_the_transformer_towards_the_velocity(preset):
    """Fifty steps on one batch with the same draws every step: the loss falls to well under half."""
    models = load_models(preset, None, seed=0)
    batch = {"pixel_values": torch.rand(2, 3, 32, 32) * 2 - 1, "caption": ["a red dog", "a blue cat"]}
    optimizer = torch.optim.AdamW(models.denoiser.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        loss = diffusion_loss(models.denoiser, models, batch, CPU, step_generator(0, 1, 0, 0, CPU))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_the_unet_family_s_noise_schedule_options_are_refused(tmp_path, shards_dir, train_args, capsys):
    # a preset's family: refused as the options are parsed (the pipeline refuses the recipe alike, contracts.recipe)
    with pytest.raises(SystemExit):
        train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--model-config", "tiny-sd3",
                   "--prediction-type", "v_prediction")
    assert "--prediction-type: options of the UNet family's noise schedule; a sd3 model" in capsys.readouterr().err
    # a base's family, known once it loads: refused then
    options = argparse.Namespace(prediction_type=None, zero_terminal_snr=False, snr_gamma=5.0, noise_offset=0.0)
    with pytest.raises(ValueError, match="--snr-gamma.*a pixart model trains with flow matching"):
        check_flow_run(PIXART, options)


def test_an_sd3_run_whose_widest_bucket_passes_its_position_table_is_refused_before_its_first_step(
        tmp_path, shards_dir, train_args, capsys):
    # tiny-sd3's table covers 256 px (32 patches of 2 latent pixels of 4 image pixels); a 256 px phase's
    # aspect buckets reach 352 px, where diffusers would raise at the first such batch
    assert widest_side([256], 8, True) == 352 and widest_side([256, 128], 8, False) == 256
    with pytest.raises(SystemExit):  # a preset run: refused as its options are parsed, as the pipeline refuses it
        train_args(shards_dir, tmp_path / "m", tmp_path / "c", "--model-config", "tiny-sd3", "--resolution", "256")
    assert "widest image side at resolution 256 is 352 px (its aspect buckets), but tiny-sd3's position table covers 256 px" \
        in capsys.readouterr().err
    models = load_models("tiny-sd3", None, seed=0)  # a base's transformer: checked at the run's start
    with pytest.raises(ValueError, match=r"widest image side is 352 px .* covers 256 px \(pos_embed_max_size 32"):
        check_positions(models.denoiser, models.vae_scale_factor, 352, "a base")
    check_positions(models.denoiser, models.vae_scale_factor, 256, "tiny-sd3")  # squares at 256 px fit
    pixart = load_models("tiny-pixart", None, seed=0)
    check_positions(pixart.denoiser, pixart.vae_scale_factor, 4096, "tiny-pixart")  # no table to outgrow


def test_a_preset_whose_parts_do_not_fit_fails_before_any_data_is_read(tmp_path, monkeypatch):
    preset = json.loads((CONFIGS / "tiny-sd3.json").read_text())
    preset["transformer"]["pooled_projection_dim"] = 48  # the two CLIPs project to 32 + 32
    (tmp_path / "bad-sd3.json").write_text(json.dumps(preset))
    monkeypatch.setattr("trainer.models.loading.CONFIGS_DIR", tmp_path)
    with pytest.raises(BaseModelError, match="pooled_projection_dim is 48 but the CLIP projections give 64"):
        load_models("bad-sd3", None, seed=0)


# ---------------------------------------------------------------- a run, its pipeline, evaluation and serving


@pytest.fixture(scope="module", params=FAMILIES, ids=[family[0] for family in FAMILIES])
def trained_family(request, tmp_path_factory, shards_dir):
    preset, pipeline_class, scheduler_class = request.param
    root = tmp_path_factory.mktemp(preset)
    args = train.parse_args(["--train-dir", str(shards_dir), "--model-dir", str(root / "model"), "--checkpoint-dir",
                             str(root / "ckpt"), "--model-config", preset, "--resolution", "32", "--batch-size", "2",
                             "--num-workers", "0", "--log-every", "1", "--steps", "3", "--checkpoint-every", "2",
                             "--validation-prompts", "a red dog", "--validation-inference-steps", "2"])
    before = load_models(preset, None, seed=0).denoiser.state_dict()
    record = train.main(args)
    return {"preset": preset, "pipeline_class": pipeline_class, "scheduler_class": scheduler_class,
            "model_dir": root / "model", "record": record, "health": root / "model" / "health", "before": before}


def test_a_run_trains_the_transformer_and_saves_the_family_s_pipeline(trained_family):
    assert torch.isfinite(torch.tensor(trained_family["record"]["final_loss"]))
    # prepared: FluxPipeline's own default size is 128 latent pixels whatever the model (the others read their config)
    pipeline = prepared(DiffusionPipeline.from_pretrained(trained_family["model_dir"]))
    assert type(pipeline) is trained_family["pipeline_class"]
    assert type(pipeline.scheduler) is trained_family["scheduler_class"]
    after = pipeline.transformer.state_dict()
    assert any(not torch.equal(after[name], value) for name, value in trained_family["before"].items())
    image = pipeline("a red dog", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                     **sampling_options(pipeline)).images[0]
    assert image.size == (32, 32)  # the resolution the run ended at
    assert list((trained_family["health"] / "validation").glob("step-*.png"))


def test_a_checkpoint_s_denoiser_loads_with_the_family_s_class(trained_family):
    pipeline = DiffusionPipeline.from_pretrained(trained_family["model_dir"])
    last = trained_family["model_dir"].parent / "ckpt" / "step-00000003"

    ema = type(pipeline.transformer).from_pretrained(last / "ema_unet")  # the saved pipeline holds the EMA weights

    assert json.loads((last / "unet" / "config.json").read_text())["_class_name"] == type(pipeline.transformer).__name__
    assert all(torch.equal(ema.state_dict()[name], value) for name, value in pipeline.transformer.state_dict().items())


def test_the_saved_pipeline_conditions_captions_as_training_did(trained_family, shards_dir):
    """The tokenizers (learned from the shards' captions) and text encoders saved with the model give the
    embeddings the run trained on."""
    saved = from_pretrained(trained_family["model_dir"])
    fresh = load_models(trained_family["preset"], None, seed=0, captions=lambda: read_captions(shards_dir))
    captions = ["a red dog on a blue background", ""]
    trained_on = condition(fresh.family, fresh.text_pipeline(), captions, CPU)
    pipeline = DiffusionPipeline.from_pretrained(trained_family["model_dir"])
    served = condition(saved.family, pipeline, captions, CPU)
    assert torch.equal(trained_on.context, served.context)
    for part in ("pooled", "mask"):
        assert (getattr(trained_on, part) is None) == (getattr(served, part) is None)
        assert getattr(trained_on, part) is None or torch.equal(getattr(trained_on, part), getattr(served, part))


def test_pixart_s_t5_reads_the_longest_caption_s_tokens_and_gives_what_the_300_padded_call_gives():
    """The transformer sees the mask's positions alone (cross-attention masked, stored members cut at the mask), so
    T5 runs on the batch's longest caption, not on the 300 positions the pipeline pads every caption to."""
    captions = ["a red circle on a blue background", "", "A Woman in a navy raincoat crossing Shibuya at dusk, rain"]
    models = load_models("tiny-pixart", None, seed=0, captions=lambda: captions * 4)
    pipeline = models.text_pipeline()
    got = condition(models.family, pipeline, captions, CPU)
    padded, mask, _, _ = pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=CPU,
                                                max_sequence_length=models.family.max_length)
    assert torch.equal(got.mask, mask) and got.context.shape == padded.shape
    kept = mask.bool()
    torch.testing.assert_close(got.context[kept], padded[kept], rtol=1e-5, atol=1e-5)
    assert not got.context[~kept].any()


def test_sampling_reads_the_prompt_as_training_encoded_it(trained_family):
    """PixArt's pipeline cleans a prompt (lower case, no URLs, ...) where bs4 and ftfy are installed unless told not
    to; training's encode_prompt never does, so the sampling options tell it not to."""
    pipeline = DiffusionPipeline.from_pretrained(trained_family["model_dir"])
    cleaned = []
    if hasattr(pipeline, "_text_preprocessing"):
        real = pipeline._text_preprocessing
        pipeline._text_preprocessing = lambda text, clean_caption=False: cleaned.append(clean_caption) or real(text, False)
    pipeline("a red dog", num_inference_steps=1, output_type="latent", **sampling_options(pipeline))
    assert set(cleaned) <= {False} and (cleaned or trained_family["pipeline_class"] is not PixArtSigmaPipeline)


def test_the_validation_loss_is_the_mean_over_eight_equidistant_timesteps_with_fixed_noise(trained_family):
    models = from_pretrained(trained_family["model_dir"])
    samples = [EvalSample(f"k{i}", f"a red dog number {i}", torch.rand(3, 32, 32) * 2 - 1, []) for i in range(2)]
    losses = flow_validation_losses(models, samples, seed=0, device=CPU)
    assert losses.shape == (2, 8) and torch.equal(losses, flow_validation_losses(models, samples, seed=0, device=CPU))
    summary = flow_loss_summary(losses)
    assert list(summary["val_loss_by_timestep"]) == ["0", "0.125", "0.25", "0.375", "0.5", "0.625", "0.75", "0.875"]
    assert summary["val_loss"] == pytest.approx(losses.mean().item())


def test_a_loaded_model_samples_at_the_shift_it_was_saved_with(trained_family):
    """Evaluation samples a saved model through build_pipeline: the shift is the saved sampler's at the size the run
    ended at (tiny presets: 0.5 at 32 px), not a default's, and grows with the side as in training."""
    saved = DiffusionPipeline.from_pretrained(trained_family["model_dir"]).scheduler.config
    saved_shift = saved.get("shift") if trained_family["scheduler_class"] is FlowMatchEulerDiscreteScheduler else saved.flow_shift
    assert saved_shift == 0.5  # tiny presets: 1.0 at 64 px, the run ended at 32
    models = from_pretrained(trained_family["model_dir"])
    for side, shift in ((32, 0.5), (64, 1.0)):
        config = build_pipeline(models, models.denoiser, side).scheduler.config
        assert (config.get("shift") or config.get("flow_shift")) == pytest.approx(shift)


def test_the_model_server_serves_the_family_and_keeps_its_flow_sampler(trained_family):
    pipeline = load_pipeline(trained_family["model_dir"])
    apply_levers(pipeline, {"scheduler": "dpmpp", "fuse_qkv": False, "channels_last": False, "compile": "off"})
    assert type(pipeline.scheduler) is trained_family["scheduler_class"]  # DPM-Solver++ would sample a DDPM schedule
    images = generate(pipeline, Generation("a red dog", num_inference_steps=2, height=48, width=32))
    assert images[0].size == (32, 48)


def test_a_flux_trained_here_is_served_with_true_cfg_as_the_run_s_record_says(trained_family):
    """The run built its transformer from the preset and dropped captions (atelier-training.json): it learned the
    unconditional prediction true CFG guides away from (trainer/models/families.py learned_unconditional)."""
    pipeline = load_pipeline(trained_family["model_dir"])
    assert ("true_cfg_scale" in sampling_options(pipeline, 4.0)) == (trained_family["pipeline_class"] is FluxPipeline)
    record = json.loads((trained_family["model_dir"] / "atelier-training.json").read_text())
    assert record["learned_unconditional"] is True  # kept for a run that continues from this model


def test_fused_qkv_serves_a_family_model_the_same_images(trained_family):
    plain = load_pipeline(trained_family["model_dir"])
    fused = load_pipeline(trained_family["model_dir"], ServeSettings(fuse_qkv=True))  # the pipeline has no fuse_qkv_projections
    request = Generation("a red dog", num_inference_steps=2, height=32, width=32)
    torch.testing.assert_close(torch.tensor(np.array(generate(fused, request)[0]), dtype=torch.float32),
                               torch.tensor(np.array(generate(plain, request)[0]), dtype=torch.float32), atol=2, rtol=0)


def test_a_side_the_model_cannot_draw_is_a_400_that_says_why(trained_family):
    """SD3's position table (tiny-sd3: 256 px) and a transformer's size multiple (VAE x patch) bound a request's
    sides: the pipeline would fail on them, a 500."""
    pipeline = load_pipeline(trained_family["model_dir"])
    with InferenceServer("127.0.0.1", 0, ServeSettings(max_side=512), PROVENANCE, pipeline) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        connection = http.client.HTTPConnection(*server.server_address, timeout=60)
        connection.request("POST", "/invocations", json.dumps({"prompt": "a red dog", "height": 264, "width": 32}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        status, body = response.status, response.read()
        server.shutdown()
    if trained_family["preset"] == "tiny-sd3":
        assert (status, json.loads(body)["error"]) == (400, '"height" must be at most 256 for this model (its position table)')
    else:  # PixArt computes its positions for any size
        assert status == 200 and body.startswith(b"\x89PNG")
    with pytest.raises(BadRequest, match='"width" must be a multiple of 8 for this model'):
        check_request(pipeline, Generation("a red dog", height=32, width=36))


def test_an_sd3_model_without_t5_is_saved_and_served(tmp_path, monkeypatch):
    """T5 is optional for SD3: the pipeline saves text_encoder_3 as null, which from_pretrained must be told."""
    preset = json.loads((CONFIGS / "tiny-sd3.json").read_text())
    del preset["text_encoders"]["t5"]
    preset["transformer"]["joint_attention_dim"] = 64  # the two CLIPs' 32 + 32, zero-padded to nothing
    (tmp_path / "sd3-no-t5.json").write_text(json.dumps(preset))
    monkeypatch.setattr("trainer.models.loading.CONFIGS_DIR", tmp_path)
    models = load_models("sd3-no-t5", None, seed=0)
    assert [folder for folder, _ in models.text_folders] == ["text_encoder", "text_encoder_2"]
    build_pipeline(models, models.denoiser, 32).save_pretrained(tmp_path / "model")
    pipeline = load_pipeline(tmp_path / "model")
    assert pipeline.text_encoder_3 is None
    assert generate(pipeline, Generation("a red dog", num_inference_steps=2, height=32, width=32))[0].size == (32, 32)


def test_a_pixart_model_trained_off_its_preset_size_is_saved_with_the_positions_it_trained_with(tmp_path):
    # GIVEN tiny-pixart (built for 64 px) trained at 32 px: its positional embedding at an 8x8 latent
    models = load_models("tiny-pixart", None, seed=0, captions=lambda: ["a red dog"])
    latents = torch.randn(1, 4, 8, 8)
    trained = models.denoiser.pos_embed(latents)
    # WHEN the run saves its model with 32 px as the default size
    save_model(models, models.denoiser.state_dict(), 32, tmp_path / "model", None)
    saved = DiffusionPipeline.from_pretrained(tmp_path / "model")
    # THEN the loaded transformer draws 32 px by default and reads the same positions
    assert saved.transformer.config.sample_size * 4 == 32
    torch.testing.assert_close(saved.transformer.pos_embed(latents), trained)


def test_a_flux_base_without_a_default_size_takes_flux_pipeline_s_and_one_of_ours_keeps_its_own(tmp_path):
    """FLUX.1-dev's transformer config holds no sample_size (FluxPipeline draws 128 latent pixels a side by default);
    a tiny-flux model (built for 64 px) trained at 32 px keeps that size, and the pipeline loaded back draws it."""
    models = load_models("tiny-flux", None, seed=0, captions=lambda: ["a red dog"])
    save_model(models, models.denoiser.state_dict(), 32, tmp_path / "ours", None)
    assert prepared(DiffusionPipeline.from_pretrained(tmp_path / "ours")).default_sample_size == 8  # 32 px
    config = json.loads((tmp_path / "ours" / "transformer" / "config.json").read_text())
    del config["sample_size"]
    (tmp_path / "ours" / "transformer" / "config.json").write_text(json.dumps(config))
    assert from_pretrained(tmp_path / "ours").default_resolution == 128 * 4  # the tiny VAE's downsampling
    assert prepared(DiffusionPipeline.from_pretrained(tmp_path / "ours")).default_sample_size == 128
