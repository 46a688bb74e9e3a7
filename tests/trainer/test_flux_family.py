"""Flux.1's layout (trainer/models/families.py FLUX): its transformer's inputs as FluxPipeline gives them, its
guidance (true CFG, or embedded for a distilled base), and its sampler's shift. The run, the saved pipeline and
serving are tests/trainer/test_transformer_families.py's, with the other families."""

import copy
import json
import math

import pytest
import torch
from diffusers import FluxPipeline

from tests.trainer.precision_helpers import micro_batches, trained
from trainer.models import families
from trainer.models.families import Conditioning, layout, negative_prompt, predict, sampling_options
from trainer.models.loading import CONFIGS_DIR, from_pretrained, load_models
from trainer.models.pipelines import build_pipeline
from trainer.serve.generation import check_request
from trainer.serve.levers import denoiser_mode
from trainer.serve.protocol import BadRequest, Generation

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def flux():
    return load_models("tiny-flux", None, seed=0, captions=lambda: ["a red dog", "a blue cat"])


@pytest.fixture
def distilled(tmp_path, monkeypatch):
    """tiny-flux with FLUX.1-dev's guidance embedding: its guidance is an input of the transformer."""
    preset = json.loads((CONFIGS_DIR / "tiny-flux.json").read_text())
    preset["transformer"]["guidance_embeds"] = True
    (tmp_path / "flux-distilled.json").write_text(json.dumps(preset))
    monkeypatch.setattr("trainer.models.loading.CONFIGS_DIR", tmp_path)
    return load_models("flux-distilled", None, seed=0, captions=lambda: ["a red dog"])


@pytest.mark.parametrize("guidance_embeds", [False, True])
def test_the_velocity_is_the_transformer_s_output_on_the_inputs_flux_pipeline_gives_it(flux, distilled, guidance_embeds):
    """What FluxPipeline.__call__ does at one step: latents packed 2x2, its image ids, zero text ids, the timestep in
    [0, 1] (the transformer scales it by 1000) and a distilled transformer's guidance; the output unpacked."""
    models = distilled if guidance_embeds else flux
    noisy, t = torch.randn(2, 16, 8, 12), torch.tensor([0.3, 0.8])
    conditioning = families.condition(models.family, models.text_pipeline(), ["a red dog", "a blue cat"], CPU)
    assert conditioning.packed and conditioning.guidance == (families.FLUX_TRAINING_GUIDANCE if guidance_embeds else None)
    with torch.no_grad():
        ours = predict(models.denoiser, noisy, t, conditioning)
        packed = FluxPipeline._pack_latents(noisy, 2, 16, 8, 12)
        pipeline_s = models.denoiser(
            hidden_states=packed, timestep=t, guidance=torch.full((2,), 3.5) if guidance_embeds else None,
            pooled_projections=conditioning.pooled, encoder_hidden_states=conditioning.context,
            txt_ids=torch.zeros(conditioning.context.shape[1], 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 6, CPU, torch.float32)).sample
        unpacked = FluxPipeline._unpack_latents(pipeline_s, 8 * 4, 12 * 4, 4)  # pixels, the tiny VAE's 4x
    assert torch.equal(ours, unpacked)


def test_a_flux_step_runs_its_forward_and_its_checkpointed_recompute_off_cudnn_s_attention(flux):
    """On the GPU cuDNN's SDPA backward gave Flux NaN gradients (families.FLUX_TRAINING_ATTENTION); and a forward
    recomputed by gradient checkpointing inside the backward, outside the forward's backends, picked other kernels
    and failed checkpoint's metadata check (FLUX.1's layout at 1024 px)."""
    # GIVEN the tiny Flux transformer with gradient checkpointing, its first block noting the SDPA setting it runs in
    start = copy.deepcopy(flux.denoiser)
    start.enable_gradient_checkpointing()
    seen = []
    start.transformer_blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    # WHEN one training step runs (trainer.jobs.step.train_step)
    trained(flux, start, micro_batches(1, flux.default_resolution), steps=1, device=CPU, bf16=False)
    # THEN the block ran twice, in the forward and in the backward's recompute, both off cuDNN's kernels; and the
    # process's setting is as it was
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_stored_embeddings_are_marked_with_the_transformer_s_layout(flux, distilled):
    stored = {"prompt_embeds": torch.zeros(1, 512, 64), "pooled_prompt_embeds": torch.zeros(1, 32)}
    plain = layout(flux.family, flux.denoiser, Conditioning.from_tensors(stored))
    guided = layout(distilled.family, distilled.denoiser, Conditioning.from_tensors(stored))
    assert (plain.packed, plain.guidance) == (True, None)
    assert (guided.packed, guided.guidance) == (True, families.FLUX_TRAINING_GUIDANCE)
    assert layout(families.SD3, flux.denoiser, Conditioning.from_tensors(stored)).packed is False


def test_an_undistilled_flux_is_sampled_with_true_cfg_and_one_empty_negative_a_prompt(flux):
    pipeline = build_pipeline(flux, flux.denoiser, 32)
    assert sampling_options(pipeline, 4.0)["true_cfg_scale"] == 4.0
    assert sampling_options(pipeline)["true_cfg_scale"] == families.FLUX_SAMPLING_GUIDANCE
    assert negative_prompt(pipeline, None) == "" and negative_prompt(pipeline, None, 3) == ["", "", ""]
    assert negative_prompt(pipeline, ["ugly"] * 3, 3) == ["ugly"] * 3
    # compiled without CUDA graphs: the two calls a step would overwrite each other's graph outputs
    assert denoiser_mode(pipeline, "reduce-overhead") == "default"
    assert denoiser_mode(pipeline, "max-autotune") == "max-autotune-no-cudagraphs"


def test_a_distilled_flux_takes_its_guidance_embedded_and_refuses_a_negative_prompt(distilled):
    pipeline = build_pipeline(distilled, distilled.denoiser, 32)
    assert "true_cfg_scale" not in sampling_options(pipeline, 4.0) and negative_prompt(pipeline, None) is None
    assert denoiser_mode(pipeline, "reduce-overhead") == "reduce-overhead"  # one call a step
    check_request(pipeline, Generation("a red dog", height=32, width=32))
    with pytest.raises(BadRequest, match='"negative_prompt" has no effect on this model'):
        check_request(pipeline, Generation("a red dog", negative_prompt="blurry", height=32, width=32))
    with pytest.raises(BadRequest, match=r'"width" must be a multiple of 8 .* its patch of 2\)'):
        check_request(pipeline, Generation("a red dog", height=32, width=36))


def test_a_sampler_that_shifts_by_image_tokens_is_read_at_the_model_s_own_size(flux, tmp_path):
    """A FLUX.1-dev base's scheduler shifts by the image's tokens (use_dynamic_shifting): a LoRA on it is evaluated
    at the shift serving gives its own size, exp(mu) with mu linear in the tokens (diffusers' calculate_shift)."""
    build_pipeline(flux, flux.denoiser, 32).save_pretrained(tmp_path / "model")
    config_path = tmp_path / "model" / "scheduler" / "scheduler_config.json"
    config = {**json.loads(config_path.read_text()), "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
              "base_image_seq_len": 256, "max_image_seq_len": 4096}
    config_path.write_text(json.dumps(config))
    tokens = (16 // 2) ** 2  # tiny-flux's own 16 latent pixels a side, packed 2x2
    assert families.FLUX.saved_shift(tmp_path / "model") == pytest.approx(
        math.exp(0.5 + 0.65 * (tokens - 256) / 3840))
    assert families.dynamic_shift(config, 4096) == pytest.approx(math.exp(1.15))  # FLUX.1 at 1024 px: 3.16
    assert from_pretrained(tmp_path / "model").flow.shift(64) == pytest.approx(families.FLUX.saved_shift(tmp_path / "model"))
