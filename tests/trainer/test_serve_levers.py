"""The model server's speed levers (trainer.serve.levers, settings): parsed from $SERVE_*, applied by load_pipeline, and the generation thread."""

import http.client
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from diffusers.models.attention_processor import FusedAttnProcessor2_0
from PIL import Image

from trainer.models.loading import load_models
from trainer.models.pipelines import build_pipeline
from trainer.serve.generation import generate, load_pipeline
from trainer.serve.levers import NO_CUDA, Batcher, inductor_mode, lever_plan
from trainer.serve.protocol import Generation
from trainer.serve.server import InferenceServer
from trainer.serve.settings import Provenance, ServeSettings

PROVENANCE = Provenance("m", "d", "a")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny preset with random weights, saved as a training job saves its pipeline (64 px)."""
    directory = tmp_path_factory.mktemp("tiny-pipeline")
    models = load_models("tiny", None, 0)
    build_pipeline(models, models.denoiser).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def plain(model_dir):
    return load_pipeline(model_dir, ServeSettings(compile="off", cuda_graphs=False))


def pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


# ---------------------------------------------------------------- settings


def test_the_levers_come_from_the_environment():
    assert ServeSettings.from_env({
        "SERVE_SCHEDULER": "dpmpp", "SERVE_FUSE_QKV": "1", "SERVE_CHANNELS_LAST": "true", "SERVE_COMPILE": "max-autotune",
        "SERVE_CUDA_GRAPHS": "0", "SERVE_WARMUP_IMAGES": "1,2,4", "SERVE_BATCH_WINDOW_MS": "25", "SERVE_MAX_BATCH": "16",
    }) == ServeSettings(scheduler="dpmpp", fuse_qkv=True, channels_last=True, compile="max-autotune", cuda_graphs=False,
                        warmup_images=(1, 2, 4), batch_window_ms=25.0, max_batch=16)


def test_by_default_a_gpu_server_compiles_with_cuda_graphs_and_nothing_else():
    settings = ServeSettings.from_env({})
    assert (settings.compile, settings.cuda_graphs, settings.warmup_images) == ("default", True, (1,))
    assert (settings.scheduler, settings.fuse_qkv, settings.channels_last, settings.batch_window_ms) == ("default", False, False, 0.0)
    assert ServeSettings.from_env({"SERVE_BATCH_WINDOW_MS": "0"}).batch_window_ms == 0.0


@pytest.mark.parametrize(("name", "value", "message"), [
    ("SERVE_SCHEDULER", "euler", r"^\$SERVE_SCHEDULER must be one of default, dpmpp, got 'euler'$"),
    ("SERVE_COMPILE", "fast", r"^\$SERVE_COMPILE must be one of off, default, max-autotune, got 'fast'$"),
    ("SERVE_FUSE_QKV", "yes", r"^\$SERVE_FUSE_QKV must be 1 or 0, got 'yes'$"),
    ("SERVE_WARMUP_IMAGES", "1,0", r"^\$SERVE_WARMUP_IMAGES must be a positive int, got '0'$"),
    ("SERVE_BATCH_WINDOW_MS", "-5", r"^\$SERVE_BATCH_WINDOW_MS must be a non-negative float, got '-5'$"),
    ("SERVE_MAX_BATCH", "0", r"^\$SERVE_MAX_BATCH must be a positive int, got '0'$"),
])
def test_a_lever_setting_that_does_not_parse_fails_at_start(name, value, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings.from_env({name: value})


@pytest.mark.parametrize(("compile_mode", "cuda_graphs", "mode"), [
    ("off", False, None), ("off", True, None),
    ("default", False, "default"), ("default", True, "reduce-overhead"),
    ("max-autotune", False, "max-autotune-no-cudagraphs"), ("max-autotune", True, "max-autotune"),
])
def test_compile_and_cuda_graphs_pick_inductors_mode(compile_mode, cuda_graphs, mode):
    assert inductor_mode(compile_mode, cuda_graphs) == mode


def test_on_a_cpu_nothing_compiles_and_the_plan_says_why():
    plan = lever_plan(ServeSettings(), cuda=False)
    assert plan["compile"] == NO_CUDA
    assert lever_plan(ServeSettings(), cuda=True)["compile"] == "reduce-overhead"


# ---------------------------------------------------------------- applied by load_pipeline


def test_load_pipeline_applies_the_levers_the_settings_turn_on(model_dir):
    pipeline = load_pipeline(model_dir, ServeSettings(scheduler="dpmpp", fuse_qkv=True, channels_last=True))

    assert isinstance(pipeline.scheduler, DPMSolverMultistepScheduler)
    assert pipeline.scheduler.config.algorithm_type == "dpmsolver++"
    assert pipeline.scheduler.config.beta_schedule == "scaled_linear"  # the saved noise schedule, kept
    processors = pipeline.unet.attn_processors.values()
    assert processors and all(isinstance(processor, FusedAttnProcessor2_0) for processor in processors)
    assert pipeline.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipeline.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipeline.unet._compiled_call_impl is None  # the CPU: compile skipped (test above)


def test_the_plain_settings_leave_the_saved_pipeline_as_it_is(plain):
    assert type(plain.scheduler).__name__ == "DDIMScheduler"
    assert not any(isinstance(processor, FusedAttnProcessor2_0) for processor in plain.unet.attn_processors.values())
    assert plain.unet.conv_in.weight.is_contiguous()


def test_fused_projections_and_channels_last_give_the_plain_images(model_dir, plain):
    generation = Generation("a red dog", num_inference_steps=2, seed=3)
    fast = load_pipeline(model_dir, ServeSettings(fuse_qkv=True, channels_last=True))

    difference = np.abs(pixels(generate(fast, generation)) - pixels(generate(plain, generation)))
    assert difference.max() <= 1  # the same arithmetic in another order: a rounding step at most


# ---------------------------------------------------------------- the generation thread


def submit_together(batcher: Batcher, generations: list) -> list:
    results = [None] * len(generations)

    def send(index):
        results[index] = batcher.submit(generations[index])

    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(generations))]
    for thread in threads:
        thread.start()
        time.sleep(0.01)  # in this order
    for thread in threads:
        thread.join(10)
    return results


def recording_batcher(window_s: float, max_images: int = 8):
    calls = []

    def run(generations):
        calls.append([generation.seed for generation in generations])
        return [[f"image of seed {seed}" for seed in generation.seeds] for generation in generations]

    return Batcher(run, lambda generation: generation.num_inference_steps, window_s, max_images), calls


def test_without_a_window_every_request_is_its_own_call():
    batcher, calls = recording_batcher(window_s=0)
    results = submit_together(batcher, [Generation("a", seed=seed) for seed in (1, 2, 3)])
    assert results == [["image of seed 1"], ["image of seed 2"], ["image of seed 3"]]
    assert sorted(calls) == [[1], [2], [3]]
    batcher.close()


def test_requests_within_the_window_share_one_call_and_each_gets_its_own_images():
    batcher, calls = recording_batcher(window_s=0.5)
    results = submit_together(batcher, [Generation("a", seed=1), Generation("b", seed=5, num_images=2), Generation("c", seed=9)])
    assert calls == [[1, 5, 9]]
    assert results == [["image of seed 1"], ["image of seed 5", "image of seed 6"], ["image of seed 9"]]
    batcher.close()


def test_a_request_that_cannot_share_the_call_waits_for_the_next():
    batcher, calls = recording_batcher(window_s=0.5, max_images=2)
    generations = [Generation("a", seed=1), Generation("a", seed=2, num_inference_steps=5), Generation("a", seed=3),
                   Generation("a", seed=4)]
    submit_together(batcher, generations)
    # other steps (seed 2) never join; a third image does not fit in 2 (seed 4)
    assert calls == [[1, 3], [2], [4]]
    batcher.close()


def test_a_failed_call_fails_each_of_its_requests_and_the_thread_keeps_serving():
    def run(generations):
        if any(generation.prompt == "bad" for generation in generations):
            raise RuntimeError("CUDA error")
        return [["ok"] for _ in generations]

    batcher = Batcher(run, lambda generation: 0, 0, 8)
    with pytest.raises(RuntimeError, match="CUDA error"):
        batcher.submit(Generation("bad"))
    assert batcher.submit(Generation("good")) == ["ok"]
    batcher.close()


def post(server, payload) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    connection.request("POST", "/invocations", json.dumps(payload).encode(), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def test_requests_batched_over_http_get_the_images_they_get_alone(plain):
    # GIVEN a server with a batch window and three requests sent at once
    settings = ServeSettings(batch_window_ms=500, max_batch=4)
    payloads = [{"prompt": prompt, "num_inference_steps": 2, "seed": seed}
                for prompt, seed in (("a red dog", 1), ("a blue cat", 2), ("a green tree", 3))]
    replies = [None] * len(payloads)
    calls = []
    with InferenceServer("127.0.0.1", 0, settings, PROVENANCE, plain) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        run = server.generations.run
        server.generations.run = lambda generations: calls.append(len(generations)) or run(generations)

        def send(index):
            replies[index] = post(server, payloads[index])

        threads = [threading.Thread(target=send, args=(index,)) for index in range(len(payloads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        server.shutdown()
    # THEN they ran as one call; each PNG carries its own seed and the pixels it gets alone (to a rounding step)
    assert calls == [3]
    for payload, (status, body) in zip(payloads, replies):
        assert status == 200
        image = Image.open(io.BytesIO(body))
        assert image.text["atelier:seed"] == str(payload["seed"])
        alone = generate(plain, Generation(payload["prompt"], num_inference_steps=2, seed=payload["seed"]))
        assert np.abs(pixels([image.convert("RGB")]) - pixels(alone)).max() <= 1
