"""trainer.jobs.step.train_step: one optimizer step of the tiny UNet on the CPU, the objective's options passed through."""

import copy

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.jobs import train
from trainer.jobs.step import StepSettings, Trainee, train_step
from trainer.models.loading import load_models
from trainer.objectives.diffusion import diffusion_loss
from trainer.objectives.numerics import step_generator
from trainer.runtime.distributed import Processes
from trainer.runtime.ema import EMA
from trainer.runtime.health import Window

CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)


def micro_batch(number: int) -> dict:
    """Two 32 px images as the loader yields them (pixels in [-1, 1], captions, bookkeeping)."""
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(number)) * 2 - 1
    return {"pixel_values": pixels, "caption": ["a red dog", "a blue cat"], "key": [f"k{number}a", f"k{number}b"],
            "corrupt": [], "shard": ["shard-a.tar"], "source": [("p", "cc-by-4.0")] * 2}


def trainee_of(models) -> Trainee:
    optimizer = torch.optim.AdamW(models.denoiser.parameters(), lr=1.0)
    schedule = LambdaLR(optimizer, lambda done: 1e-3)
    return Trainee(models.denoiser, models.denoiser, models.denoiser, optimizer, schedule, EMA(models.denoiser.named_parameters(), 0.9))


def test_a_step_is_the_mean_of_its_micro_batch_losses_with_the_objective_s_options_then_one_update():
    # GIVEN the tiny UNet, two micro-batches and a noise offset with min-SNR weighting
    models = load_models("tiny", None, seed=0)
    before = copy.deepcopy(models.denoiser)
    settings = StepSettings(seed=7, gradient_accumulation=2, noise_offset=0.1, snr_gamma=5.0)
    batches = [micro_batch(0), micro_batch(1)]
    trainee, window = trainee_of(models), Window()
    # WHEN step 3 runs
    outcome = train_step(trainee, models, iter(batches), window, settings, 3, CPU)
    # THEN its loss is the mean of each micro-batch's loss from its own generator, offset and weighting included
    with torch.no_grad():
        expected = [diffusion_loss(before, models, batch, CPU.device, step_generator(7, 3, 0, micro, CPU.device),
                                   noise_offset=0.1, snr_gamma=5.0) for micro, batch in enumerate(batches)]
    assert outcome.loss.item() == pytest.approx(sum(loss.item() for loss in expected) / 2, rel=1e-5)
    plain = diffusion_loss(before, models, batches[0], CPU.device, step_generator(7, 3, 0, 0, CPU.device))
    assert plain.item() != pytest.approx(expected[0].item(), rel=1e-3)  # the options change the loss
    # and the weights, the EMA and the schedule moved once; the window counted the images and the loss
    assert outcome.finite and outcome.learning_rate == 1e-3 and outcome.batches == batches
    assert any(not torch.equal(p, q) for p, q in zip(models.denoiser.parameters(), before.parameters()))
    assert trainee.ema.updates == 1 and trainee.lr_schedule.last_epoch == 1
    assert all(p.grad is None for p in models.denoiser.parameters())
    assert (window.images, window.good_steps) == (4, 1) and window.loss_sum.item() == pytest.approx(outcome.loss.item())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_non_finite_step_leaves_the_weights_and_the_ema_as_they_were(monkeypatch):
    models = load_models("tiny", None, seed=0)
    before = copy.deepcopy(models.denoiser.state_dict())
    monkeypatch.setattr("trainer.jobs.step.diffusion_loss", lambda *args, **kw: diffusion_loss(*args, **kw) * torch.nan)
    trainee, window = trainee_of(models), Window()

    outcome = train_step(trainee, models, iter([micro_batch(0)]), window, StepSettings(), 1, CPU)

    assert not outcome.finite
    assert all(torch.equal(value, before[name]) for name, value in models.denoiser.state_dict().items())
    assert trainee.ema.updates == 0 and trainee.lr_schedule.last_epoch == 1  # the schedule moves on regardless
    assert (window.images, window.good_steps) == (2, 0)


def test_the_step_s_defaults_are_the_trainer_s(tmp_path):
    args = train.parse_args(["--train-dir", str(tmp_path), "--model-dir", str(tmp_path / "model")])
    assert StepSettings.from_args(args) == StepSettings()
