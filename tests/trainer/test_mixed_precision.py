"""The step's bf16 path on a CPU: bf16 autocast (trainer/objectives/numerics.py, switched on here for the CPU)
with the frozen parts in bf16, and bf16 weights with fp32 masters (trainer/speed/master_weights.py), against
fp32. A GPU job runs this path; tests/gpu/ runs it there, with --compile and --cuda-graphs too."""

import copy

import pytest
import torch

from tests.trainer.precision_helpers import loss_gap, micro_batches, trained, trainee_of, weight_drift
from trainer.models.loading import load_models
from trainer.objectives import numerics
from trainer.speed.master_weights import MasterWeights

CPU = torch.device("cpu")
STEPS = 10  # at lr 1e-4 the tiny UNet's loss falls by a sixth in 10 steps: the weights move well past bf16's rounding


def test_autocast_is_bf16_on_a_gpu_and_off_on_a_cpu_unless_asked(monkeypatch):
    assert numerics.AUTOCAST_DEVICE_TYPES == {"cuda"}
    with numerics.autocast(CPU):
        assert not torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(numerics, "AUTOCAST_DEVICE_TYPES", frozenset({"cpu"}))
    with numerics.autocast(CPU, cache=False):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("preset", ["tiny", "tiny-sd3"])
def test_bf16_autocast_steps_train_as_fp32_steps_do(preset):
    # GIVEN the tiny model's weights and four micro-batches of two 32 px images
    models = load_models(preset, None, seed=0)
    start, batches = copy.deepcopy(models.denoiser), micro_batches(4, 32)
    # WHEN 10 steps run from them in fp32, and again in bf16 autocast with the frozen parts in bf16
    reference, reference_run = trained(models, start, batches, STEPS, CPU, bf16=False)
    losses, run = trained(models, start, batches, STEPS, CPU, bf16=True)
    # THEN autocast ran (the losses differ), and the loss curves agree to 1% at every step: bf16 keeps 8 bits of
    # mantissa (0.4% a rounding), but the loss is an fp32 mean over thousands of rounded products (seen: 0.10%
    # for tiny, 0.04% for tiny-sd3, over 20 steps)
    assert losses != reference
    assert loss_gap(losses, reference) <= 0.01
    # and the weights ended apart by at most 35% of how far training moved them. AdamW moves each weight about
    # lr a step whatever its gradient's size, so a gradient that bf16 flips in sign moves a weight the other way:
    # seen 12% (tiny) and 1.3% (tiny-sd3) after 20 steps. Weights that did not train end 100% apart
    assert weight_drift(run.unet, reference_run.unet, start) <= 0.35


def test_bf16_weights_with_fp32_masters_train_as_fp32_weights_under_autocast_do():
    # GIVEN the tiny UNet's weights and four micro-batches, and the step in bf16 autocast as on a GPU
    models = load_models("tiny", None, seed=0)
    start, batches = copy.deepcopy(models.denoiser), micro_batches(4, 32)
    # WHEN 10 steps run with fp32 weights, and again with bf16 weights whose fp32 masters AdamW, clipping and
    # the EMA take (the step's Trainee.unet is the masters)
    reference, reference_run = trained(models, start, batches, STEPS, CPU, bf16=True)
    losses, run = trained(models, start, batches, STEPS, CPU, bf16=True,
                          build=lambda unet: trainee_of(unet, weights=MasterWeights(unet)))
    # THEN the same bounds as bf16 against fp32, and for the same reasons: bf16 weights round each weight once more
    # than autocast's casts do, inside the same 8 bits (seen: 0.11% and 17% after 20 steps)
    assert (next(run.unet.parameters()).dtype, next(run.model.parameters()).dtype) == (torch.float32, torch.bfloat16)
    assert loss_gap(losses, reference) <= 0.01
    assert weight_drift(run.unet, reference_run.unet, start) <= 0.35
