"""Flux.1's layout (trainer/models/families.py FLUX): its transformer's inputs as FluxPipeline gives them, its
guidance (true CFG where its run's record says it learned an unconditional prediction, none for a base such as
FLUX.1-schnell, embedded for a guidance-distilled base), and its sampler's shift. The run, the saved pipeline and
serving are tests/trainer/test_transformer_families.py's, with the other families."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import FluxPipeline
from PIL import Image

from contracts.s3_layout import TRAINING_RECORD
from tests.trainer.precision_helpers import micro_batches, trained
from trainer.jobs import sampling
from trainer.jobs.sampling import check_health, save_model
from trainer.models import families
from trainer.models.families import Conditioning, layout, negative_prompt, predict, sampling_options
from trainer.models.loading import CONFIGS_DIR, from_pretrained, load_models
from trainer.models.pipelines import build_pipeline
from trainer.runtime import health
from trainer.runtime.run_state import RunState
from trainer.serve.generation import check_request, generate, load_pipeline
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


def record(train_args, shards_dir, models, *options: str) -> dict:
    """atelier-training.json as trainer/jobs/train.py writes it for a run of these options on these models."""
    args = train_args(shards_dir, shards_dir / "model", shards_dir / "ckpt", "--model-config", "tiny-flux", *options)
    return RunState(vars(args)).record(models.sources, [], "trained")


def saved(models, folder, run_record: dict | None = None):
    """The run's saved pipeline folder, with its record beside it (none: a base trained elsewhere)."""
    save_model(models, models.denoiser.state_dict(), 32, folder, str(models.base) if models.base else None)
    if run_record is not None:
        (folder / "atelier-training.json").write_text(json.dumps(run_record))  # as trainer/jobs/train.py names it
    return folder


@pytest.fixture(scope="module")
def schnell(flux, tmp_path_factory):
    """FLUX.1-schnell's case in small: a Flux pipeline folder without guidance embeddings and no Atelier record."""
    return saved(flux, tmp_path_factory.mktemp("flux") / "schnell")


@pytest.fixture(scope="module")
def on_schnell(schnell):
    """A run's models on that base (--pretrained): its transformer is the base's."""
    return load_models("tiny-flux", str(schnell), seed=0)


@pytest.fixture(scope="module")
def scratch_record(flux, train_args, shards_dir):
    """The record of a tiny Flux trained here from the preset, with the default caption dropout (0.1)."""
    return record(train_args, shards_dir, flux)


def transformer_calls_a_step(pipeline, steps: int = 2, **request) -> float:
    calls = []
    hook = pipeline.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        generate(pipeline, Generation("a red dog", num_inference_steps=steps, height=32, width=32, **request))
    finally:
        hook.remove()
    return len(calls) / steps


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


def test_a_flux_trained_here_is_sampled_with_true_cfg_and_one_empty_negative_a_prompt(flux, scratch_record):
    pipeline = build_pipeline(flux, flux.denoiser, 32)
    families.note_training(pipeline.transformer, scratch_record)
    assert sampling_options(pipeline, 4.0)["true_cfg_scale"] == 4.0
    assert sampling_options(pipeline)["true_cfg_scale"] == families.FLUX_SAMPLING_GUIDANCE
    assert negative_prompt(pipeline, None) == "" and negative_prompt(pipeline, None, 3) == ["", "", ""]
    assert negative_prompt(pipeline, ["ugly"] * 3, 3) == ["ugly"] * 3
    # compiled without CUDA graphs: the two calls a step would overwrite each other's graph outputs
    assert denoiser_mode(pipeline, "reduce-overhead") == "default"
    assert denoiser_mode(pipeline, "max-autotune") == "max-autotune-no-cudagraphs"


def test_a_distilled_flux_takes_its_guidance_embedded_and_refuses_a_negative_prompt(distilled, train_args,
                                                                                   shards_dir, tmp_path):
    # trained here from its preset with caption dropout, but its guidance is the transformer's input
    run_record = record(train_args, shards_dir, distilled)
    pipeline = load_pipeline(saved(distilled, tmp_path / "model", run_record))
    guidance = []
    pipeline.transformer.register_forward_pre_hook(lambda _, __, kwargs: guidance.append(kwargs["guidance"]), with_kwargs=True)
    assert transformer_calls_a_step(pipeline, guidance_scale=4.0) == 1
    assert all(torch.equal(given, torch.tensor([4.0])) for given in guidance)
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


@pytest.mark.parametrize("run, calls", [("scratch", 2), ("scratch, no caption dropout", 1), ("base", 1),
                                        ("fine-tune on the base", 1)])
def test_a_flux_without_guidance_embeddings_is_guided_unasked_only_where_its_record_says_it_learned_the_unconditional(
        flux, schnell, on_schnell, train_args, shards_dir, tmp_path, run, calls):
    """True CFG (two transformer calls a step) where its run built the transformer from the preset and dropped
    captions; FLUX.1-schnell (timestep-distilled, sampled unguided in a few steps), a run on it or a run that never
    saw an empty caption is sampled as FluxPipeline samples it by default, by the server and by evaluation."""
    folder = {"scratch": lambda: saved(flux, tmp_path / "model", record(train_args, shards_dir, flux)),
              "scratch, no caption dropout": lambda: saved(
                  flux, tmp_path / "model", record(train_args, shards_dir, flux, "--caption-dropout", "0")),
              "base": lambda: schnell,
              "fine-tune on the base": lambda: saved(on_schnell, tmp_path / "model", record(
                  train_args, shards_dir, on_schnell, "--pretrained", str(schnell)))}[run]()
    served = load_pipeline(folder)
    assert transformer_calls_a_step(served) == calls
    evaluated = from_pretrained(folder)
    assert ("true_cfg_scale" in sampling_options(build_pipeline(evaluated, evaluated.denoiser, 32))) == (calls == 2)


def test_a_request_s_negative_prompt_asks_a_flux_base_without_guidance_embeddings_for_true_cfg(schnell):
    pipeline = load_pipeline(schnell)
    assert transformer_calls_a_step(pipeline, negative_prompt="blurry", guidance_scale=4.0) == 2
    assert sampling_options(pipeline, 4.0, "blurry")["true_cfg_scale"] == 4.0
    assert transformer_calls_a_step(pipeline, negative_prompt="blurry", guidance_scale=1.0) == 1  # FluxPipeline's rule
    # any request may bring one: compiled without CUDA graphs, which would overwrite one call's output with the other's
    assert denoiser_mode(pipeline, "reduce-overhead") == "default"


@pytest.mark.parametrize("on_base, calls", [(False, 2), (True, 1)])
def test_validation_samples_a_run_as_its_saved_model_will_be_served(flux, on_schnell, schnell, train_args, shards_dir,
                                                                    tmp_path, monkeypatch, on_base, calls):
    """The validation grid of a run on FLUX.1-schnell (here a full fine-tune) without true CFG, of a run from the
    preset with it: the same record the saved model is served by, from the run's arguments and sources."""
    models = on_schnell if on_base else flux
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--model-config", "tiny-flux",
                      "--validation-prompts", "a red dog", "--validation-seeds", "0",
                      *(("--pretrained", str(schnell)) if on_base else ()))
    seen = []

    def grid(pipeline, *rest, **options):
        hook = pipeline.transformer.register_forward_hook(lambda *_: seen.append(1))
        health.validation_grid(pipeline, *rest, **options)
        hook.remove()
        return Image.new("RGB", (8, 8))
    monkeypatch.setattr(sampling, "validation_grid", grid)
    plan = SimpleNamespace(phase=lambda step: SimpleNamespace(resolution=32))
    check_health(args, SimpleNamespace(rank=0, device=CPU), models, models.denoiser, None, plan, 1, [], tmp_path,
                 SimpleNamespace(validation=lambda step, image: None))
    assert len(seen) / args.validation_inference_steps == calls


@pytest.mark.parametrize("run_record, learned", [
    (None, False),
    ({"args": {"caption_dropout": 0.1}, "components": {"transformer": "tiny-flux (random)"}}, True),
    ({"args": {"caption_dropout": 0.0}, "components": {"transformer": "tiny-flux (random)"}}, False),
    ({"args": {"caption_dropout": 0.1}, "components": {"transformer": "--pretrained s3://b/flux-schnell"}}, False),
    ({"args": {"caption_dropout": 0.1}, "components": {"transformer": "tiny-flux (random)"},
      "learned_unconditional": False}, False),  # what the run recorded rules
])
def test_the_rule_reads_the_transformer_s_source_and_the_caption_dropout(run_record, learned):
    assert families.learned_unconditional(run_record) is learned


@pytest.mark.parametrize("base_learned, dropout, learned", [(True, 0.1, True), (False, 0.1, False), (True, 0.0, False)])
def test_a_run_continued_on_a_model_trained_here_keeps_its_guidance(base_learned, dropout, learned):
    """A fine-tune or LoRA on a Flux trained here from its preset: the base's record says it learned the unconditional,
    and captions still dropped keep it."""
    run_record = {"args": {"caption_dropout": dropout}, "components": {"transformer": "--pretrained /opt/ml/input/base"}}
    assert families.learned_unconditional(run_record, {"learned_unconditional": base_learned}) is learned


def test_a_record_that_does_not_read_is_no_record(tmp_path):
    (tmp_path / TRAINING_RECORD).write_text("{not json")
    assert families.saved_record(tmp_path) is None and families.saved_record(None) is None
