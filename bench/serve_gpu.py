"""Benchmark the endpoint's model server (trainer/serve/server.py) on the SD-2-size pipeline: one JSON line per figure.

    PYTHONUNBUFFERED=1 python bench/serve_gpu.py --out $OUT/serve.jsonl        # one H200, under 600 s
    .venv/bin/python bench/serve_gpu.py --model-config tiny --size 64 --steps 2  # CPU smoke run

Everything served is the server's own code path: the preset built with random weights by the
trainer's code (trainer.models.loading.load_models + trainer.models.pipelines.build_pipeline, saved
with save_pretrained, as a training job saves its model), loaded by
trainer.serve.generation.load_pipeline with a ServeSettings, and run by
trainer.serve.generation.generate on a Generation from trainer.serve.protocol.parse_request. The baseline is plain
diffusers on the same directory: StableDiffusionPipeline.from_pretrained(dir, torch_dtype=bf16) on
the GPU, its saved scheduler, no compile, the same prompt, steps, guidance, size and seeds (fp32 on
a CPU, as the server runs there).

Lines (`<size>` is --size):
- `serve.p50_latency_s_<size>`, `serve.p99_latency_s_<size>`: the server as the environment
  configures it ($SERVE_* read by ServeSettings.from_env, as the endpoint reads them), one image a
  request, --timed requests after --warmup, timed A B A B against diffusers in the same process.
- `serve.ratio_vs_diffusers`: diffusers' p50 / the server's p50 (goal >= 2.0).
- `serve.http_p50_latency_s_<size>`: the same server behind its InferenceServer, one client posting
  one request at a time (HTTP, parsing and PNG encoding included), generations on the thread that
  warmed the pipeline up, as trainer.serve.server.main runs them.
- `serve.img_per_s_<size>`: the server's images/s at the batch (images a request, --batches) that
  maximises it; the sweep stops once a batch gains under 3%.
- `serve.cold_start_s`: `python -m trainer.container serve` (the image's entrypoint) started on a
  free port with a fresh Inductor cache: process start -> GET /ping 200 -> the first PNG.
- `serve.lever.<name>`: one lever alone on the plain server (every lever off): `value` is the plain
  p50 / the lever's p50 (above 1: faster), timed A B A B, with the lever's output against plain's
  on the same seed (`psnr_db_vs_plain`, `mean_abs_diff_vs_plain`, 0..255). Levers (--levers):
  channels_last, fuse_qkv, compile (max-autotune, no CUDA graphs), cuda_graphs (Inductor's default
  mode with CUDA graphs: "reduce-overhead"),
  dpmpp (DPM-Solver++ at --fast-steps against the saved scheduler at --steps), batching (--clients
  concurrent one-image requests over HTTP to an InferenceServer with a --window-ms batch window,
  against the same server without one; images/s).

--deadline (seconds after process start) skips what would not finish before it, with a line saying
so; compiled configurations are started only with --compile-needs seconds left.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# first: the harness starts the clock (PROCESS_START) before torch loads
from bench.serve_harness import (  # noqa: E402
    LEVERS,
    PROCESS_START,
    PROMPT,
    RANDOM_WEIGHTS,
    alternate,
    build_model,
    concurrent_requests,
    difference,
    diffusers_call,
    left,
    lever_fields,
    load_diffusers,
    note,
    over_http,
    release,
    request,
    sequential_requests,
    server_settings,
    settings_for,
    summary,
    timed,
    wait_for_ping,
    warm,
)

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from bench.stamp import commit, versions  # noqa: E402
from trainer.serve.generation import generate, load_pipeline, warm_up  # noqa: E402
from trainer.serve.levers import compiled, lever_plan  # noqa: E402
from trainer.serve.settings import ServeSettings  # noqa: E402


# ---------------------------------------------------------------- figures


def headline(args, directory: Path, emit, common: dict):
    """The server as configured against diffusers, A B A B; then the server's throughput sweep."""
    settings = server_settings(args)
    plan = lever_plan(settings, torch.cuda.is_available())
    if compiled(plan) and left(args) < args.compile_needs + 60:
        emit({"metric": f"serve.p50_latency_s_{args.size}", "value": None, "unit": "s",
              "skipped": f"{left(args):.0f} s left; a compiled server needs {args.compile_needs} s", **common})
        return None
    generation = request(args)
    started = time.time()
    ours = load_pipeline(directory, settings)
    load_s = time.time() - started
    baseline = load_diffusers(directory)
    calls = {"diffusers": lambda: diffusers_call(baseline, generation), "server": lambda: generate(ours, generation)}
    first = {name: warm(call, args.warmup)[0] for name, call in calls.items()}
    seconds = alternate(calls, args.timed)
    note(event="headline", **{name: summary(values) for name, values in seconds.items()})
    ours_s, theirs_s = summary(seconds["server"]), summary(seconds["diffusers"])
    config = {"steps": args.steps, "size": args.size, "images_per_request": 1, "guidance": generation.guidance_scale,
              "levers": plan, "settings": lever_fields(settings), "load_s": round(load_s, 1),
              "first_call_s": round(first["server"], 2), "warmup": args.warmup, "order": "A B A B (diffusers, server)",
              "path": "trainer.serve.generation.load_pipeline + generate (no HTTP, no PNG)"}
    emit({"metric": f"serve.p50_latency_s_{args.size}", "value": ours_s["p50_s"], "unit": "s", **ours_s,
          "config": config, **common})
    emit({"metric": f"serve.p99_latency_s_{args.size}", "value": ours_s["p99_s"], "unit": "s",
          "config": config, **common})
    emit({"metric": f"serve.diffusers_p50_latency_s_{args.size}", "value": theirs_s["p50_s"], "unit": "s", **theirs_s,
          "config": {**config, "levers": None, "settings": None,
                     "path": "StableDiffusionPipeline.from_pretrained(dir, torch_dtype=bf16), its saved scheduler, no compile",
                     "first_call_s": round(first["diffusers"], 2)}, **common})
    emit({"metric": "serve.ratio_vs_diffusers", "value": round(theirs_s["p50_s"] / ours_s["p50_s"], 3),
          "unit": "diffusers p50 / server p50", "goal": 2.0, "server_p50_s": ours_s["p50_s"],
          "diffusers_p50_s": theirs_s["p50_s"], "config": config, **common})
    http_s = over_http(ours, settings, lambda address: sequential_requests(args, address))
    emit({"metric": f"serve.http_p50_latency_s_{args.size}", "value": summary(http_s)["p50_s"], "unit": "s",
          **summary(http_s), "config": {**config, "path": "POST /invocations to trainer.serve.server.InferenceServer, one "
                                        "client, one request at a time: HTTP, JSON parsing and PNG encoding included"},
          **common})
    if args.sweep:
        sweep(args, ours, baseline, settings, emit, common)
    return ours


def sweep(args, ours, baseline, settings: ServeSettings, emit, common: dict) -> None:
    """Images/s at each batch of --batches until one gains under 3% (or fails); the best one's line."""
    plan = lever_plan(settings, torch.cuda.is_available())
    rates, best = {}, None
    for images in args.batches:
        if left(args) < (args.compile_needs if compiled(plan) else 30):
            rates[images] = f"skipped: {left(args):.0f} s left"
            break
        generation = request(args, images=images)
        try:
            if compiled(plan) and images not in settings.warmup_images:
                warm_up(ours, (images,))  # as $SERVE_WARMUP_IMAGES would have at start
            warm(lambda: generate(ours, generation), 1)
            seconds = [timed(lambda: generate(ours, generation))[0] for _ in range(args.sweep_timed)]
        except torch.OutOfMemoryError:
            rates[images] = "out of memory"
            break
        rates[images] = round(images / statistics.median(seconds), 3)
        note(event="sweep", images=images, img_per_s=rates[images])
        if best is not None and rates[images] < rates[best] * 1.03:
            best = max(best, images, key=lambda n: rates[n])
            break
        best = images if best is None or rates[images] > rates[best] else best
    if best is None:
        return
    generation = request(args, images=best)
    warm(lambda: diffusers_call(baseline, generation), 1)
    theirs = best / statistics.median([timed(lambda: diffusers_call(baseline, generation))[0] for _ in range(args.sweep_timed)])
    emit({"metric": f"serve.img_per_s_{args.size}", "value": rates[best], "unit": "img/s", "batch": best,
          "diffusers_img_per_s_same_batch": round(theirs, 3), "ratio_vs_diffusers_same_batch": round(rates[best] / theirs, 3),
          "config": {"steps": args.steps, "size": args.size, "by_batch": rates, "levers": plan,
                     "batch_means": "images in one request (num_images); classifier-free guidance doubles the UNet's batch",
                     "timed_per_batch": args.sweep_timed}, **common})


def lever(args, name: str, directory: Path, plain, plain_images: list, emit, common: dict) -> None:
    """One lever alone on the plain server, A B A B against the plain one."""
    settings = settings_for(args, LEVERS[name])
    plan = lever_plan(settings, torch.cuda.is_available())
    base = {"metric": f"serve.lever.{name}", "unit": "plain p50 / lever p50", "levers": plan, **common}
    if plan["compile"].startswith("skipped"):
        emit({**base, "value": None, "skipped": plan["compile"]})
        return
    if left(args) < (args.compile_needs if compiled(plan) else 40):
        emit({**base, "value": None, "skipped": f"{left(args):.0f} s left before the deadline"})
        return
    steps = args.fast_steps if name == "dpmpp" else args.steps
    generation, reference = request(args, steps=steps), request(args)
    started = time.time()
    try:
        pipeline = load_pipeline(directory, settings)  # compiles and records the graphs, where it does
        load_s = time.time() - started
        first_s, images = warm(lambda: generate(pipeline, generation), args.warmup)
        seconds = alternate({"lever": lambda: generate(pipeline, generation),
                             "plain": lambda: generate(plain, reference)}, args.timed)
    except (RuntimeError, torch.OutOfMemoryError) as error:  # a lever that fails leaves the others their run
        emit({**base, "value": None, "error": f"{type(error).__name__}: {str(error)[:300]}"})
        release()
        return
    mine, theirs = summary(seconds["lever"]), summary(seconds["plain"])
    line = {**base, "value": round(theirs["p50_s"] / mine["p50_s"], 3), "lever_p50_s": mine["p50_s"],
            "lever_p99_s": mine["p99_s"], "plain_p50_s": theirs["p50_s"], "load_and_warmup_s": round(load_s, 1),
            "first_call_s": round(first_s, 2), "steps": steps, "plain_steps": args.steps}
    if name == "dpmpp":  # the same seeds: DPM-Solver++ at N steps and the saved scheduler at N, each against it at --steps
        line["quality_vs_plain_at_steps"] = difference(images, plain_images)
        line["plain_at_fast_steps_vs_plain_at_steps"] = difference(generate(plain, generation), plain_images)
        line["note"] = (f"both against the saved scheduler's {args.steps}-step image, seed 0; {RANDOM_WEIGHTS}: "
                        "DPM-Solver++ should land nearer it than the saved scheduler at the same few steps")
    else:
        line.update({f"{key}_vs_plain": value for key, value in difference(images, plain_images).items()})
        line["note"] = f"same request and seed as plain; {RANDOM_WEIGHTS}"
    emit(line)
    del pipeline
    release()


def batching(args, plain, emit, common: dict) -> None:
    """--clients concurrent one-image requests over HTTP, with and then without a batch window."""
    base = {"metric": "serve.lever.batching", "unit": "img/s with the window / without", **common}
    if left(args) < 60:
        emit({**base, "value": None, "skipped": f"{left(args):.0f} s left before the deadline"})
        return
    results = {}
    for window_ms in (0.0, args.window_ms, 0.0, args.window_ms):  # A B A B
        settings = replace(settings_for(args, {}), batch_window_ms=window_ms, max_batch=args.clients)
        run = over_http(plain, settings, lambda address: concurrent_requests(args, address))
        results.setdefault(window_ms, []).append(run)
        note(event="batching", window_ms=window_ms, **run)
    rate = {window: statistics.median(run["img_per_s"] for run in runs) for window, runs in results.items()}
    latency = {window: statistics.median(run["p50_s"] for run in runs) for window, runs in results.items()}
    emit({**base, "value": round(rate[args.window_ms] / rate[0.0], 3), "img_per_s_batched": round(rate[args.window_ms], 3),
          "img_per_s_unbatched": round(rate[0.0], 3), "request_p50_s_batched": latency[args.window_ms],
          "request_p50_s_unbatched": latency[0.0],
          "config": {"clients": args.clients, "requests_per_client": args.client_requests, "window_ms": args.window_ms,
                     "max_batch": args.clients, "steps": args.steps, "size": args.size, "order": "A B A B",
                     "path": "trainer.serve.server.InferenceServer over HTTP (PNG encoding included), plain levers"}})


def cold_start(args, directory: Path, emit, common: dict) -> None:
    """The image's entrypoint on a free port: process start -> /ping 200 -> the first PNG."""
    settings = server_settings(args)
    plan = lever_plan(settings, torch.cuda.is_available())
    base = {"metric": "serve.cold_start_s", "unit": "s", "levers": plan, **common}
    if left(args) < (args.compile_needs if compiled(plan) else 60):
        emit({**base, "value": None, "skipped": f"{left(args):.0f} s left before the deadline"})
        return
    root = Path(tempfile.mkdtemp(prefix="atelier-serve-cold-"))
    (root / "model").symlink_to(directory.resolve())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    python_path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "functions"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "ATELIER_OPT_ML": str(root), "SAGEMAKER_BIND_HOST": "127.0.0.1",
           "SAGEMAKER_BIND_TO_PORT": str(port), "PYTHONPATH": python_path,
           "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}  # cold: none of this process's compiled kernels
    body = json.dumps({"prompt": PROMPT, "num_inference_steps": args.steps, "height": args.size,
                       "width": args.size}).encode()
    started = time.time()
    process = subprocess.Popen([sys.executable, "-m", "trainer.container", "serve"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ready = wait_for_ping(port, process, started, time.time() + max(left(args) - 20, 30))
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=max(left(args) - 10, 30))
        connection.request("POST", "/invocations", body, {"Content-Type": "application/json", "Accept": "image/png"})
        response = connection.getresponse()
        png = response.read()
        first_png = time.time() - started
        if response.status != 200 or not png.startswith(b"\x89PNG"):
            raise RuntimeError(f"/invocations answered {response.status}: {png[:200]!r}")
    except (RuntimeError, OSError) as error:
        process.kill()
        log = process.communicate()[0].decode(errors="replace")[-1500:]
        emit({**base, "value": None, "error": f"{type(error).__name__}: {error}", "log_tail": log})
        return
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)
    emit({**base, "value": round(first_png, 1), "ping_200_s": round(ready, 1), "first_request_s": round(first_png - ready, 2),
          "config": {"command": "python -m trainer.container serve", "steps": args.steps, "size": args.size,
                     "inductor_cache": "empty (TORCHINDUCTOR_CACHE_DIR fresh)", "model": "fp32 safetensors on local disk, "
                     "page cache warm (this process wrote or read it)", "settings": lever_fields(settings)}})


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="sd2", help="a preset in trainer/configs/")
    parser.add_argument("--size", type=int, default=512, help="image side, px")
    parser.add_argument("--steps", type=int, default=30, help="inference steps a request asks")
    parser.add_argument("--fast-steps", type=int, default=None, help="the dpmpp lever's steps (half of --steps)")
    parser.add_argument("--timed", type=int, default=10, help="timed one-image requests per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per configuration first")
    parser.add_argument("--batches", default="1,2,4,8,16", help="images a request for the throughput sweep")
    parser.add_argument("--sweep-timed", type=int, default=2, help="timed requests per batch of the sweep")
    parser.add_argument("--levers", default=",".join(LEVERS), help=f"levers to measure, of {', '.join(LEVERS)}")
    parser.add_argument("--no-cold-start", dest="cold_start", action="store_false")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="no throughput sweep")
    parser.add_argument("--no-headline", dest="headline", action="store_false",
                        help="levers (and cold start) only: no server-vs-diffusers figures, no sweep")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients for the batching lever")
    parser.add_argument("--client-requests", type=int, default=2, help="requests each client sends")
    parser.add_argument("--window-ms", type=float, default=50.0, help="the batching lever's window")
    parser.add_argument("--pipeline", default=None, help="the saved pipeline's directory (built there if absent)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    parser.add_argument("--deadline", type=float, default=540, help="seconds after process start; later figures are skipped")
    parser.add_argument("--compile-needs", type=float, default=200, help="seconds a compiled configuration needs")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    args = parser.parse_args(argv)
    args.batches = [int(n) for n in args.batches.split(",") if n]
    args.fast_steps = args.fast_steps or max(1, args.steps // 2)
    args.levers = [name for name in args.levers.split(",") if name]
    unknown = sorted(set(args.levers) - set(LEVERS))
    if unknown or not args.batches:
        parser.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}" if unknown else "--batches is empty")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    machine = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "nproc": os.cpu_count(), "host": platform.node()}
    common = {"commit": commit(), "machine": machine, "versions": versions(), "model_config": args.model_config,
              "precision": "bf16" if cuda else "fp32 (CPU)", "attention": "SDPA (diffusers AttnProcessor2_0)"}

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(text + "\n")

    directory = build_model(args)
    # the server as configured; the plain one when $SERVE_* sets no lever
    plain = headline(args, directory, emit, common) if args.headline else None
    if plain is None or lever_fields(server_settings(args)) != lever_fields(settings_for(args, {})):
        plain = None
        release()
        plain = load_pipeline(directory, settings_for(args, {}))
    if args.cold_start:
        cold_start(args, directory, emit, common)
    plain_images = warm(lambda: generate(plain, request(args)), 1)[1]
    for name in args.levers:
        note(event="lever", name=name)
        if name == "batching":
            batching(args, plain, emit, common)
        else:
            lever(args, name, directory, plain, plain_images, emit, common)
    note(event="done", s=round(time.time() - PROCESS_START, 1))


if __name__ == "__main__":
    main()
