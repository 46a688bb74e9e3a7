"""bench/serve_gpu.py runs end to end on a CPU with the tiny preset: every figure it promises, one line each."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_serving_benchmark_prints_each_figure_on_a_cpu(tmp_path):
    out = tmp_path / "serve.jsonl"
    # one OpenMP thread: on a small shared CPU, spinning OpenMP workers slow every step many times over
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_COMMIT": "test"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "serve_gpu.py"), "--model-config", "tiny", "--size", "64",
                    "--steps", "2", "--timed", "2", "--warmup", "1", "--batches", "1,2", "--clients", "2",
                    "--client-requests", "1", "--pipeline", str(tmp_path / "pipeline"), "--out", str(out)],
                   cwd=ROOT, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)

    lines = {line["metric"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert list(lines) == [
        "serve.p50_latency_s_64", "serve.p99_latency_s_64", "serve.diffusers_p50_latency_s_64", "serve.ratio_vs_diffusers",
        "serve.http_p50_latency_s_64", "serve.img_per_s_64", "serve.cold_start_s", "serve.lever.batching",
        "serve.lever.channels_last", "serve.lever.fuse_qkv", "serve.lever.dpmpp", "serve.lever.cuda_graphs",
        "serve.lever.compile",
    ]
    for line in lines.values():
        assert {"commit", "machine", "versions", "unit"} <= set(line) and line["commit"] == "test"
    measured = [name for name, line in lines.items() if name not in ("serve.lever.cuda_graphs", "serve.lever.compile")]
    assert all(lines[name]["value"] > 0 for name in measured)
    # the p50 and the ratio come from the same A B A B timings
    assert lines["serve.ratio_vs_diffusers"]["value"] == round(
        lines["serve.diffusers_p50_latency_s_64"]["value"] / lines["serve.p50_latency_s_64"]["value"], 3)
    # the first image comes after the first 200 from /ping (the two times are rounded to 0.1 s, their gap to 0.01 s)
    cold = lines["serve.cold_start_s"]
    assert cold["first_request_s"] > 0 and cold["ping_200_s"] <= cold["value"]
    assert lines["serve.lever.dpmpp"]["steps"] == 1 and "consistency check" in lines["serve.lever.dpmpp"]["note"]
    assert 0 < lines["serve.lever.fuse_qkv"]["psnr_db_vs_plain"] <= 100
    # a CPU compiles nothing: the compiled levers say so instead of timing the eager model
    for name in ("serve.lever.cuda_graphs", "serve.lever.compile"):
        assert lines[name]["value"] is None and lines[name]["skipped"].startswith("skipped: no CUDA device")
