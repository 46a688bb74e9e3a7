"""bench/diffusers_baseline.py names its ratio by the shards our line read (bench/metric_definitions.py), with a
stand-in for the diffusers script that prints the script's progress bar."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.metric_definitions import problems

ROOT = Path(__file__).resolve().parents[2]
PEER = """import sys, time
for step in range(1, 31):
    time.sleep(0.02)
    print(f"Steps: {100 * step // 30:3d}%|###   | {step}/30 [00:01<00:10, 1.00it/s]", flush=True)
"""
SOURCES = {"image": ("image512", "image shards, VAE + text encoder online"),
           "latent": ("latent512+compile", "latent shards (trainer/jobs/encode.py) through the trainer's loader; "
                                           "text encoder online on stored ids")}


@pytest.mark.parametrize("source, metric", [("image", "train.ratio_vs_diffusers_512"),
                                            ("latent", "train.ratio_vs_diffusers_512_latent")])
def test_the_ratio_is_named_by_the_shards_ours_read(tmp_path: Path, source: str, metric: str) -> None:
    # GIVEN our line on image or latent shards, and a stand-in for the peer script
    (tmp_path / "peer.py").write_text(PEER)
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "model_index.json").write_text("{}")  # built already: nothing to build
    name, label = SOURCES[source]
    (tmp_path / "ours.jsonl").write_text(json.dumps({
        "metric": f"train.img_per_s_512_{source}", "value": 120.0, "unit": "img/s", "model_config": "sd2",
        "config": {"name": name, "source": label, "batch": 32, "resolution": 512, "img_per_s_window_mean": 119.0}}) + "\n")
    # WHEN the baseline script compares it with the peer's run
    subprocess.run([sys.executable, str(ROOT / "bench" / "diffusers_baseline.py"), "--script", str(tmp_path / "peer.py"),
                    "--images", str(tmp_path), "--pipeline", str(tmp_path / "pipeline"), "--steps", "8", "--warmup", "2",
                    "--ours", str(tmp_path / "ours.jsonl"), "--ours-source", source, "--out", str(tmp_path / "out.jsonl"),
                    "--output-dir", str(tmp_path / "peer-out")],
                   cwd=ROOT, env={**os.environ, "BENCH_COMMIT": "test"}, check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # THEN its ratio has the name whose definition is what it measured
    ratios = [line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
              if line["metric"].startswith("train.ratio_vs_diffusers")]
    assert [line["metric"] for line in ratios] == [metric]
    assert problems(ratios[0]) == []
    assert ("goal" in ratios[0]) == (source == "image")  # BENCHMARKS.md: a goal of 2.0 on image shards only
