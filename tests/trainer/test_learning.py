"""The trainer learns: on the procedural catalogue, from scratch on a CPU, the autoencoder job's VAE
reconstructs held-out pictures, the held-out validation loss that trainer/jobs/evaluate.py measures (fixed
timesteps and seeds) falls as the UNet trains, and the deploy gate, on those real scores, lets a
longer-trained candidate replace a shorter-trained production model and holds the reverse back.

The recipe is the demo's (samconfig.toml [local]): 32 px, v-prediction on a zero-terminal-SNR schedule.
"""

import hashlib
import json
from pathlib import Path

import pytest

from atelier.catalog import procedural_catalog
from core.deploy.gate import Thresholds, decide, parse_evaluation
from trainer.jobs import autoencoder, evaluate, train

pytestmark = pytest.mark.slow(seconds=80)
RECIPE = ["--model-config", "tiny", "--resolution", "32", "--batch-size", "16", "--learning-rate", "0.002",
          "--lr-final-fraction", "0.1",
          "--init-unet", "random", "--prediction-type", "v_prediction", "--zero-terminal-snr", "true",
          "--aspect-buckets", "false", "--num-workers", "0", "--validation-prompts", "", "--log-every", "20"]
SHORT, LONG = 20, 300  # optimizer steps of the two UNets
FACTOR = 1.5  # the held-out loss falls at least this much from SHORT to LONG steps
GATE = Thresholds(max_loss=2.0, max_loss_ratio=1.05, min_clip_delta=1.0)


def catalogue_samples(items) -> list[dict]:
    samples = []
    for item in items:
        key = hashlib.sha256(item.image).hexdigest()
        caption = item.sidecar["caption"]
        samples.append({"key": key, "extension": "png", "image": item.image, "caption": caption, "metadata": {
            "sha256": key, "partner": "demo", "format": "png", "caption": caption, "width": 64, "height": 64,
            "license": item.sidecar["license"]}})
    return samples


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> dict:
    from tests.trainer.conftest import _write_shard
    root = tmp_path_factory.mktemp("learning")
    train_samples = catalogue_samples(procedural_catalog(1))
    _write_shard(root / "shards" / "a.tar", train_samples[: len(train_samples) // 2])
    _write_shard(root / "shards" / "b.tar", train_samples[len(train_samples) // 2:])
    _write_shard(root / "eval" / "heldout.tar", catalogue_samples(procedural_catalog(1, seed=1)[:12]))
    vae = autoencoder.main(autoencoder.parse_args([
        "--train-dir", str(root / "shards"), "--validation-dir", str(root / "eval"), "--model-dir", str(root / "vae"),
        "--model-config", "tiny", "--resolution", "32", "--steps", "300", "--batch-size", "16",
        "--learning-rate", "0.002", "--reconstruction-loss", "mse", "--aspect-buckets", "false",
        "--random-crop", "false", "--num-workers", "0", "--log-every", "100"]))
    for name, steps in (("short", SHORT), ("long", LONG)):
        train.main(train.parse_args(["--train-dir", str(root / "shards"), "--model-dir", str(root / name),
                                     "--vae", str(root / "vae"), "--steps", str(steps), *RECIPE]))
    scores = {}
    for candidate, baseline in (("long", "short"), ("short", "long")):
        scores[candidate] = evaluate.main(evaluate.parse_args([
            "--candidate-dir", str(root / candidate), "--baseline-dir", str(root / baseline),
            "--eval-dir", str(root / "eval"), "--model-dir", str(root / f"eval-{candidate}"),
            "--timesteps", "100,300,500,700,900", "--seed", "0", "--resolution", "32"]))
    return {"root": root, "vae": vae, "scores": scores}


def test_the_autoencoder_reconstructs_held_out_pictures(learned):
    vae = learned["vae"]
    assert vae["held_out"] and vae["eval_samples"] == 12
    # the random VAE is worse than guessing zeros; 300 CPU steps later it is far better than both
    assert vae["psnr_db"] >= 20 and vae["psnr_db"] >= vae["psnr_db_initial"] + 8 and vae["psnr_db"] >= vae["psnr_db_zeros"] + 8
    assert 0 < vae["scaling_factor"] < 10
    assert (learned["root"] / "vae" / "health" / "reconstructions.png").is_file()


def test_held_out_loss_falls_by_the_stated_factor(learned):
    models = learned["scores"]["long"]["models"]
    short, long = models["baseline"]["val_loss"], models["candidate"]["val_loss"]
    assert long * FACTOR <= short, (short, long)


def test_the_gate_takes_the_longer_trained_model_and_holds_the_shorter_back(learned):
    forward = parse_evaluation(json.dumps(learned["scores"]["long"]).encode())
    assert decide(forward.candidate, forward.baseline, GATE).passed
    backward = parse_evaluation(json.dumps(learned["scores"]["short"]).encode())
    decision = decide(backward.candidate, backward.baseline, GATE)
    assert not decision.passed and "production's" in decision.reason


def test_the_saved_pipeline_records_where_each_part_came_from(learned):
    record = json.loads((Path(learned["root"]) / "long" / "atelier-training.json").read_text())
    assert record["components"]["vae"] == f"--vae {learned['root'] / 'vae'}"
    assert record["components"]["unet"] == "tiny (random)"
    scheduler = json.loads((Path(learned["root"]) / "long" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["rescale_betas_zero_snr"] and scheduler["prediction_type"] == "v_prediction"
