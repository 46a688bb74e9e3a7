"""trainer/speed/regional_compile.py: a transformer family's repeated blocks compiled in place, and how a training
job chooses between that, compiling the whole UNet, and eager (--compile)."""

import json

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from trainer.data.buckets import bucket_shapes
from trainer.jobs import train
from trainer.models import lora
from trainer.models.families import condition, predict
from trainer.models.loading import load_models
from trainer.speed import fast_defaults
from trainer.speed.regional_compile import GRAPHS_A_SHAPE, REPEATED_BLOCKS, allow_graphs, compile_mode, compile_regions

CPU = torch.device("cpu")


@pytest.mark.parametrize("requested, measured_faster, family, sharded, mode", [
    ("auto", False, None, False, None),  # the table never measured compiling faster: eager
    ("auto", True, None, False, "whole"),  # the UNet family: torch.compile of the whole model
    ("auto", True, "sd3", False, "regional"),  # a transformer family: its blocks
    ("auto", True, "flux", True, None),  # sharded by FSDP over several processes: unmeasured, eager under auto
    (True, False, "flux", True, "regional"),  # ... unless asked
    (True, False, None, False, "whole"),
    (False, True, "pixart", False, None),  # the escape hatch
])
def test_the_compile_mode_follows_the_request_the_table_and_the_family(requested, measured_faster, family, sharded,
                                                                       mode):
    assert compile_mode(requested, measured_faster, family, sharded) == mode


def test_compile_auto_compiles_the_full_size_transformer_presets_at_every_measured_stage():
    """configs/defaults/fast.json: regional compilation measured faster at 256, 512 and 1024 (bench/RESULTS.md)."""
    for preset in ("sd3-medium", "pixart-sigma"):
        assert fast_defaults.compile_by_default(preset, [256, 512, 1024], on_gpu=True)
    assert fast_defaults.compile_by_default("flux1", [512, 1024], on_gpu=True)
    assert not fast_defaults.compile_by_default("flux1", [256, 512], on_gpu=True)  # 256 never measured
    assert not fast_defaults.compile_by_default("sd3-medium", [512], on_gpu=False)


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-pixart", "tiny-flux"])
def test_the_family_s_blocks_compile_in_place_and_predict_what_they_did_eagerly(preset):
    # GIVEN a tiny transformer and one noisy batch with its conditioning
    models = load_models(preset, None, seed=0, captions=lambda: ["a red dog", "a blue cat"])
    transformer = models.denoiser
    names = list(transformer.state_dict())
    side = models.default_resolution // models.vae_scale_factor
    noisy = torch.randn(2, models.vae.config.latent_channels, side, side, generator=torch.Generator().manual_seed(0))
    conditioning = condition(models.family, models.text_pipeline(), ["a red dog", "a blue cat"], CPU)
    t = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        eager = predict(transformer, noisy, t, conditioning)
    # WHEN its repeated blocks compile (Dynamo's tracing with the eager backend: Inductor on a CPU takes minutes)
    torch._dynamo.reset()
    try:
        compile_regions(transformer, models.family.name, backend="eager")
        compiled = [type(module).__name__ for module in transformer.modules()
                    if getattr(module, "_compiled_call_impl", None) is not None]
        with torch.no_grad():
            regional = predict(transformer, noisy, t, conditioning)
    finally:
        torch._dynamo.reset()
    # THEN every block of the family's named kinds, and nothing else, was compiled in place: the module tree and
    # what a checkpoint saves are unchanged, and the blocks give the eager output
    blocks = [type(module).__name__ for module in transformer.modules()
              if type(module).__name__ in REPEATED_BLOCKS[models.family.name]]
    assert compiled == blocks and len(blocks) >= 2
    assert list(transformer.state_dict()) == names
    torch.testing.assert_close(regional, eager)


def test_a_family_without_named_blocks_is_refused():
    with pytest.raises(ValueError, match="no repeated blocks are named for family 'sana'"):
        compile_regions(torch.nn.Linear(2, 2), "sana")


def test_a_compiled_transformer_job_compiles_its_blocks_not_the_whole_model(tmp_path, shards_dir, train_args,
                                                                             monkeypatch, capsys):
    """--compile true on tiny-sd3 (auto on a GPU, where the table measured it): the job compiles the family's
    blocks, not the whole model, and lets Dynamo keep a graph for every bucket shape of the run."""
    regions = []
    monkeypatch.setattr(train, "compile_regions", lambda model, family: regions.append((type(model).__name__, family)))
    monkeypatch.setattr(train, "compile_vae_encoder", lambda models: pytest.fail("the families' VAEs: not measured"))
    monkeypatch.setattr(torch, "compile", lambda *args, **options: pytest.fail("the whole model was compiled"))
    args = train_args(shards_dir, tmp_path / "model", tmp_path / "ckpt", "--steps", "1", "--model-config",
                      "tiny-sd3", "--compile", "true", "--compile-cache", "none", "--resolution", "128")
    limits = torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit  # restored after
    try:
        train.main(args)
        raised = torch._dynamo.config.recompile_limit
    finally:
        torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = limits
    limit = limits[0]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert regions == [("SD3Transformer2DModel", "sd3")]
    assert [line["compile"] for line in lines if line.get("event") == "start"] == ["regional"]
    # 128 px at tiny-sd3's size multiple of 8: more aspect buckets than Dynamo's 8 graphs a function
    [event] = [line for line in lines if line.get("event") == "compile"]
    assert event == {**event, "mode": "regional", "shapes": bucket_shapes([128], 8, True)} and event["shapes"] > limit
    assert raised == event["recompile_limit"] == GRAPHS_A_SHAPE["regional"] * event["shapes"]


def test_an_adapter_trains_through_compiled_blocks(shards_dir):
    """A LoRA job compiles the adapted model's blocks (peft's layers inside them): the adapter's gradients arrive,
    the frozen base gets none, and what a checkpoint saves keeps its names."""
    models = load_models("tiny-flux", None, seed=0, captions=lambda: ["a red dog"])
    lora.add_adapter(models.denoiser, lora.config_for("flux", rank=4), seed=0, frozen=torch.float32)
    names = list(models.denoiser.state_dict())
    torch._dynamo.reset()
    try:
        compile_regions(models.denoiser, "flux", backend="eager")
        side = models.default_resolution // models.vae_scale_factor
        noisy = torch.randn(1, models.vae.config.latent_channels, side, side)
        conditioning = condition(models.family, models.text_pipeline(), ["a red dog"], CPU)
        predict(models.denoiser, noisy, torch.tensor([0.5]), conditioning).square().mean().backward()
    finally:
        torch._dynamo.reset()
    grads = {name: p.grad for name, p in models.denoiser.named_parameters()}
    assert all(grads[name] is not None and grads[name].abs().sum() > 0 for name in grads if "lora_B" in name)
    assert all(grad is None for name, grad in grads.items() if "lora_" not in name)
    assert list(models.denoiser.state_dict()) == names


def test_a_regionally_compiled_family_keeps_a_graph_for_every_bucket_shape_of_its_run():
    """Blocks meet two kinds of input a shape under autocast (the first block fp32 hidden states, the others bf16):
    a limit of one graph a shape ran SD3-medium's fifth bucket eager (bench/RESULTS.md). With the job's limits every
    shape of a five-bucket run compiles, none falls back."""
    models = load_models("tiny-pixart", None, seed=0, captions=lambda: ["a red dog"])
    conditioning = condition(models.family, models.text_pipeline(), ["a red dog"], CPU)
    shapes = [(128, 128), (136, 120), (144, 112), (160, 96), (176, 88)]  # 128 px buckets of five different areas
    block_forward = type(models.denoiser.transformer_blocks[0]).forward.__code__
    limits = torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit
    torch._dynamo.reset()
    try:
        allow_graphs("regional", len(shapes))
        compile_regions(models.denoiser, "pixart", backend="eager")
        for width, height in shapes:
            noisy = torch.randn(1, 4, height // models.vae_scale_factor, width // models.vae_scale_factor)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                predict(models.denoiser, noisy, torch.tensor([0.5]), conditioning).float().square().mean().backward()
        graphs = len(_debug_get_cache_entry_list(block_forward))
    finally:
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = limits
    assert graphs == 2 * len(shapes) > limits[0]  # over Dynamo's default: the old limit (one a shape) ran shapes eager
