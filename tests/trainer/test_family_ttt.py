"""bench/family_ttt.py and bench/family_scores.py: the DiT and the UNet are scored by one velocity loss at the
same signal-to-noise ratios, and the time to target reads the worse of the two final losses."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler

from bench import family_ttt, time_to_target_runs
from bench.family_scores import common_times, ddpm_timesteps, implied_velocity
from bench.time_to_target_runs import Run
from trainer.objectives.diffusion import zero_terminal_snr
from trainer.objectives.flow_matching import VALIDATION_TIMESTEPS
from trainer.objectives.flow_matching import noised as flow_noised


@pytest.fixture
def unet_base(tmp_path) -> Path:
    """A base's scheduler as bench/family_ttt.py saves it: SD's schedule, v-prediction, zero-terminal SNR."""
    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type="v_prediction")
    zero_terminal_snr(scheduler).save_pretrained(tmp_path / "scheduler")
    return tmp_path


def test_the_unet_s_noisy_state_is_the_flow_state_at_the_same_time_scaled(unet_base):
    # GIVEN the common times and the UNet's timesteps for them
    scheduler = DDPMScheduler.from_pretrained(unet_base, subfolder="scheduler")
    times = common_times(unet_base)
    steps = ddpm_timesteps(scheduler.alphas_cumprod, times)
    latents, noise = torch.randn(len(times), 4, 8, 8), torch.randn(len(times), 4, 8, 8)
    # WHEN both families' noisy inputs are made from the same latents and noise
    flow_state, _ = flow_noised(latents, noise, torch.tensor(times))
    ddpm_state = scheduler.add_noise(latents, noise, torch.tensor(steps))
    # THEN the DDPM state is the flow state times alpha + sigma: the same signal-to-noise ratio
    cumprod = scheduler.alphas_cumprod[steps].view(-1, 1, 1, 1)
    torch.testing.assert_close(ddpm_state, flow_state * (cumprod.sqrt() + (1 - cumprod).sqrt()), rtol=1e-4, atol=1e-5)
    # AND the times are MLPerf's but for t = 0, which no DDPM timestep reaches
    assert times[0] > 0.01 and times[1:] == pytest.approx(VALIDATION_TIMESTEPS[1:], abs=1e-3)


@pytest.mark.parametrize("prediction_type", ["v_prediction", "epsilon"])
def test_an_exact_prediction_implies_the_exact_velocity(prediction_type):
    latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    alpha = torch.tensor([0.99, 0.7, 0.2]).view(-1, 1, 1, 1)
    sigma = (1 - alpha ** 2).sqrt()
    noisy = alpha * latents + sigma * noise
    output = alpha * noise - sigma * latents if prediction_type == "v_prediction" else noise
    torch.testing.assert_close(implied_velocity(output, noisy, alpha, sigma, prediction_type), noise - latents,
                               rtol=1e-4, atol=1e-4)


def test_the_target_is_the_worse_final_loss_and_the_ratio_the_unet_s_time_over_the_dit_s(tmp_path, monkeypatch):
    # GIVEN a DiT that ends lower than the UNet, and passes the UNet's final loss at 30 s against the UNet's 40 s
    runs = {"dit": Run("dit", 0.0, {100: 20.0, 200: 30.0, 300: 50.0}), "unet": Run("unet", 0.0, {100: 25.0, 200: 40.0})}
    scores = {"dit": {100: {"val_loss": 0.5, "grid": 0.1}, 200: {"val_loss": 0.29, "grid": 0.2}, 300: {"val_loss": 0.2, "grid": 0.4}},
              "unet": {100: {"val_loss": 0.4, "grid": 0.1}, 200: {"val_loss": 0.3, "grid": 0.3}}}
    out = tmp_path / "lines.jsonl"
    monkeypatch.setattr(time_to_target_runs, "OUT", [out])
    monkeypatch.setattr("sys.argv", ["family_ttt.py", "--work", str(tmp_path), "--plot-dir", str(tmp_path)])
    args = family_ttt.parse_args()
    # WHEN the report is made
    family_ttt.report(args, runs, scores, 96)
    # THEN the target is the UNet's final 0.3, the DiT reaches it at 30 s, the UNet at 40 s: ratio 40 / 30
    lines = {line["metric"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert lines["train.time_to_target_s_dit"]["value"] == 30.0 and lines["train.time_to_target_s_unet"]["value"] == 40.0
    assert lines["train.time_to_target_s_dit"]["config"]["target"] == 0.3
    assert lines["train.ttt_ratio_dit_vs_unet"]["value"] == round(40 / 30, 3)
    assert lines["train.time_to_target_s_dit"]["grid_at_target"] == 0.2


def test_a_second_seed_reaches_the_training_job_and_keeps_to_its_own_work_folder(tmp_path, monkeypatch):
    # GIVEN a --work whose runs were made with seed 0
    monkeypatch.setattr("sys.argv", ["family_ttt.py", "--work", str(tmp_path), "--seed", "1"])
    args = family_ttt.parse_args()
    (tmp_path / "seed").write_text("0")
    # WHEN seed 1 is asked of it THEN it refuses before it makes or trains anything
    with pytest.raises(SystemExit, match="seed 0, not 1"):
        family_ttt.prepare(args, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["seed"]
    # AND the training job draws its order, noise and timesteps from the seed asked
    flags = time_to_target_runs.recipe(args, args.seed)
    assert flags[flags.index("--seed") + 1] == "1"
