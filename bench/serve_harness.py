"""What bench/serve_gpu.py measures with: the server and diffusers loaded from one saved pipeline, requests as a
client sends them, A B A B timing, image differences, and an InferenceServer driven over HTTP.

The clock starts when this module is imported, before torch loads: bench/serve_gpu.py imports it first, so
--deadline and the progress lines' `t` count from (about) process start.
"""

import time

PROCESS_START = time.time()

import gc  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trainer.serve.protocol import Generation, parse_request  # noqa: E402
from trainer.serve.server import InferenceServer  # noqa: E402
from trainer.serve.settings import Provenance, ServeSettings  # noqa: E402

PROMPT = "a photo of a red fox sitting in a snowy forest at sunrise"
LEVERS = {  # each lever alone, as ServeSettings fields on top of the plain server; compiled ones last
    "batching": {},  # the window is the InferenceServer's (batch_window_ms), measured over HTTP
    "channels_last": {"channels_last": True},
    "fuse_qkv": {"fuse_qkv": True},
    "dpmpp": {"scheduler": "dpmpp"},
    "cuda_graphs": {"compile": "default", "cuda_graphs": True},  # Inductor's default mode + graphs: "reduce-overhead"
    "compile": {"compile": "max-autotune"},  # no graphs
}
PLAIN = {"scheduler": "default", "fuse_qkv": False, "channels_last": False, "compile": "off", "cuda_graphs": False,
         "batch_window_ms": 0.0, "warmup_images": (1,)}
RANDOM_WEIGHTS = "random weights: a consistency check of the arithmetic, not of picture quality"


def note(**fields) -> None:
    print(json.dumps({"progress": True, "t": round(time.time() - PROCESS_START, 1), **fields}), file=sys.stderr, flush=True)


def left(args) -> float:
    return args.deadline - (time.time() - PROCESS_START)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    """What a configuration left: its modules, Dynamo's caches (graphs of one configuration guard
    another's modules of the same class), the CUDA cache."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the model


def build_model(args) -> Path:
    """The preset with random weights, saved as a training job saves its pipeline; reused when there."""
    directory = Path(args.pipeline or Path(tempfile.gettempdir()) / f"atelier-serve-bench-{args.model_config}")
    if (directory / "model_index.json").is_file():
        note(event="pipeline_reused", dir=str(directory))
        return directory
    from trainer.models.loading import load_models
    from trainer.models.pipelines import build_pipeline
    started = time.time()
    # initialised on the GPU where there is one: the same architecture, minutes less of CPU init
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        models = load_models(args.model_config, None, args.seed)
    build_pipeline(models, models.denoiser).save_pretrained(directory)
    note(event="pipeline_built", dir=str(directory), s=round(time.time() - started, 1),
         unet_params_m=round(sum(p.numel() for p in models.denoiser.parameters()) / 1e6, 1))
    del models
    release()
    return directory


def request(args, steps: int | None = None, images: int = 1, seed: int = 0) -> Generation:
    """A request as a client sends it, parsed by the server's own parser."""
    body = {"prompt": PROMPT, "num_inference_steps": steps or args.steps, "seed": seed, "num_images": images,
            "height": args.size, "width": args.size}
    return parse_request(json.dumps(body).encode(), settings_for(args, {}))


def settings_for(args, levers: dict) -> ServeSettings:
    """The plain server with `levers`, its bounds raised to what the bench asks."""
    return replace(ServeSettings(), **{**PLAIN, **levers}, max_images=max(args.batches), max_steps=max(args.steps, 1000))


def server_settings(args) -> ServeSettings:
    """The server as $SERVE_* configures it, its bounds raised to what the bench asks."""
    return replace(ServeSettings.from_env(), max_images=max(args.batches), max_steps=max(args.steps, 1000))


def lever_fields(settings: ServeSettings) -> dict:
    return {name: getattr(settings, name) for name in PLAIN}


def load_diffusers(directory: Path):
    from diffusers import StableDiffusionPipeline
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    pipeline = StableDiffusionPipeline.from_pretrained(str(directory), torch_dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)  # as the server does: tqdm's redraws are no model time
    return pipeline.to("cuda" if torch.cuda.is_available() else "cpu")


def diffusers_call(pipeline, generation: Generation):
    """What a diffusers user writes for the same request."""
    return pipeline(generation.prompt, num_inference_steps=generation.num_inference_steps,
                    guidance_scale=generation.guidance_scale, height=generation.height, width=generation.width,
                    num_images_per_prompt=generation.num_images,
                    generator=[torch.Generator("cpu").manual_seed(seed) for seed in generation.seeds]).images


# ---------------------------------------------------------------- timing


def timed(call) -> tuple[float, list]:
    sync()
    started = time.perf_counter()
    images = call()
    sync()
    return time.perf_counter() - started, images


def alternate(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Each call once per round, in turn (A B A B ...): drift on a shared machine hits both alike."""
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            seconds[name].append(timed(call)[0])
    return seconds


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (p99 of 10 samples is the slowest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]


def summary(values: list[float]) -> dict:
    return {"p50_s": round(statistics.median(values), 4), "p99_s": round(percentile(values, 0.99), 4),
            "min_s": round(min(values), 4), "samples": len(values)}


def difference(a, b) -> dict:
    """Two lists of images compared pixel by pixel (uint8): PSNR (100 = identical) and mean |a - b|."""
    x = np.stack([np.asarray(image, dtype=np.float64) for image in a])
    y = np.stack([np.asarray(image, dtype=np.float64) for image in b])
    mse = float(np.mean((x - y) ** 2))
    return {"psnr_db": round(min(100.0, 10 * math.log10(255.0 ** 2 / mse)) if mse else 100.0, 2),
            "mean_abs_diff": round(float(np.mean(np.abs(x - y))), 3)}


def warm(call, count: int) -> tuple[float, list]:
    """`count` untimed calls (the first compiles, where anything does); the first's time and images."""
    first_s, images = timed(call)
    for _ in range(count - 1):
        timed(call)
    return first_s, images


# ---------------------------------------------------------------- over HTTP


def over_http(pipeline, settings: ServeSettings, client):
    """`client(address)`'s result against an InferenceServer whose generations run on this thread, as
    trainer.serve.server.main runs them (the thread that warmed the pipeline up)."""
    outcome = {}
    with InferenceServer("127.0.0.1", 0, settings, Provenance("bench", "bench", "bench"), pipeline,
                               generation_thread=False) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()

        def drive() -> None:
            try:
                outcome["value"] = client(server.server_address)
            except Exception as error:  # noqa: BLE001 - raised below, in the caller's thread
                outcome["error"] = error
            finally:
                server.generations.close()

        threading.Thread(target=drive, daemon=True).start()
        server.generations.serve()
        server.shutdown()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def post(connection, args, seed: int) -> float:
    body = json.dumps({"prompt": PROMPT, "num_inference_steps": args.steps, "seed": seed, "height": args.size,
                       "width": args.size}).encode()
    started = time.perf_counter()
    connection.request("POST", "/invocations", body, {"Content-Type": "application/json", "Accept": "image/png"})
    response = connection.getresponse()
    png = response.read()
    if response.status != 200 or not png.startswith(b"\x89PNG"):
        raise RuntimeError(f"/invocations answered {response.status}: {png[:200]!r}")
    return time.perf_counter() - started


def sequential_requests(args, address) -> list[float]:
    """--warmup then --timed one-image requests, one at a time: the timed ones' seconds."""
    connection = http.client.HTTPConnection(*address, timeout=600)
    seconds = [post(connection, args, seed) for seed in range(args.warmup + args.timed)]
    return seconds[args.warmup:]


def concurrent_requests(args, address) -> dict:
    """Every client sends its requests one after another; all clients at once."""
    latencies, failures = [], []

    def client(number: int) -> None:
        connection = http.client.HTTPConnection(*address, timeout=600)
        for count in range(args.client_requests):
            try:
                latencies.append(post(connection, args, number * 1000 + count))
            except (RuntimeError, OSError) as error:
                failures.append(error)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, the first: {failures[0]}")
    return {"img_per_s": round(len(latencies) / wall, 3), "p50_s": round(statistics.median(latencies), 3),
            "wall_s": round(wall, 2)}


def wait_for_ping(port: int, process, started: float, give_up: float) -> float:
    """Seconds from `started` to the first 200 from /ping; RuntimeError if the process ends or time runs out."""
    while time.time() < give_up:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before /ping answered 200")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return time.time() - started
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("/ping did not answer 200 before the deadline")
