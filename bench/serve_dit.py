"""The model server on a transformer-family pipeline against plain diffusers, side by side in one process.

    PYTHONUNBUFFERED=1 python bench/serve_dit.py --preset sd3-medium --resolutions 512,1024 --out $OUT/serve.jsonl

A pipeline of the preset's layout is built with random weights on the GPU and saved in bf16 (the T5 left
out: its per-request encode costs both sides the same, and building 4.7 B random parameters would take the
lease; Flux cannot do without it: `--t5-layers` cuts it), then served two ways at each resolution, 28
flow-matching Euler steps, guidance 5 (classifier-free: the transformer runs on a batch of 2, or twice a step
for Flux's true CFG, both sides given the empty negative prompt), batch 1:
- `plain`: `DiffusionPipeline.from_pretrained(dir, torch_dtype=bf16).to("cuda")`, nothing else;
- `ours`: trainer.serve.generation.load_pipeline with the server's default settings ($SERVE_COMPILE=default,
  $SERVE_CUDA_GRAPHS=1: the transformer and VAE decoder compiled, replayed as CUDA graphs), its warm-up
  compiling the resolution first (reported as `cold_start_s`: load + compile to the first servable request).
Each side's p50 over `--requests` requests after one untimed request; `serve.ratio_vs_diffusers_dit` = plain p50 /
ours p50 at the same resolution.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "functions")]

from diffusers import AutoencoderKL, DiffusionPipeline  # noqa: E402

from bench import stamp  # noqa: E402
from bench.building import drawn_in  # noqa: E402
from contracts.s3_layout import TRAINING_RECORD  # noqa: E402
from trainer.models import families, text_tokenizers  # noqa: E402
from trainer.models.loading import read_preset  # noqa: E402
from trainer.objectives.flow_matching import FlowSettings  # noqa: E402
from trainer.serve.generation import generate, load_pipeline  # noqa: E402
from trainer.serve.protocol import Generation  # noqa: E402
from trainer.serve.settings import ServeSettings  # noqa: E402

STEPS, GUIDANCE = 28, 5.0


def progress(**fields) -> None:
    print(json.dumps({"progress": True, **fields}), file=sys.stderr, flush=True)


def build(preset_name: str, folder: Path, resolution: int, t5_layers: int | None = None) -> None:
    """The preset's pipeline (no T5 where the family can do without one, `t5_layers` of it where set) with random
    weights, built on the GPU and saved in bf16."""
    preset = read_preset(preset_name)
    family = families.family_named(preset["family"])
    optional = {part.role for part in family.text_parts if not part.required}
    preset["text_encoders"] = {role: config for role, config in preset["text_encoders"].items()
                               if not (role == "t5" and role in optional)}
    if t5_layers and "t5" in preset["text_encoders"]:
        preset["text_encoders"]["t5"] = {**preset["text_encoders"]["t5"], "num_layers": t5_layers}
    # drawn as saved: FLUX.1's 11.9 B in fp32 and a bf16 copy would not fit 80 GB
    with drawn_in(torch.bfloat16), torch.device("cuda"):
        encoders, tokenizers = families.build_text_parts(family, preset, seed=0,
                                                        tokenizers=text_tokenizers.learn(preset, []))
        transformer = families.new_transformer(family, preset["transformer"])
        vae = AutoencoderKL(**preset["vae"])
    # the server warms up (compiles) at the model's default size, as a trained model's is its last stage's
    transformer.register_to_config(sample_size=resolution // 2 ** (len(vae.config.block_out_channels) - 1))
    shift = FlowSettings.from_preset(preset.get("flow")).shift(resolution)
    pipeline = families.build_pipeline(family, transformer, vae, encoders, tokenizers, shift)
    pipeline.to(torch.bfloat16).save_pretrained(folder)
    # built from the preset, it stands for a model trained here from scratch with caption dropout, and says so where
    # such a run's record does: the server guides it as that run's (a Flux by true CFG, families.learned_unconditional)
    (folder / TRAINING_RECORD).write_text(json.dumps(
        {"args": {"caption_dropout": 0.1}, "components": {"transformer": families.preset_source(preset_name)}}))


def timed(call, requests: int) -> list[float]:
    call()  # untimed: first-call allocations
    times = []
    for _ in range(requests):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sd3-medium")
    parser.add_argument("--resolutions", default="512,1024")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--t5-layers", type=int, default=None,
                        help="a required T5 cut to this many layers (its one encode a request costs both sides alike)")
    args = parser.parse_args()
    commit = stamp.commit()
    machine = {"gpu": torch.cuda.get_device_name(), "nproc": os.cpu_count()}
    out = open(args.out, "a") if args.out else None

    def emit(line: dict) -> None:
        text = json.dumps({**line, "commit": commit, "machine": machine, "preset": args.preset, "steps": STEPS,
                           "guidance": GUIDANCE, "torch": torch.__version__})
        print(text, flush=True)
        if out:
            out.write(text + "\n")
            out.flush()

    for resolution in (int(r) for r in args.resolutions.split(",")):
        folder = Path(tempfile.mkdtemp(prefix="serve-dit-"))
        started = time.perf_counter()
        build(args.preset, folder, resolution, args.t5_layers)
        progress(event="built", resolution=resolution, s=round(time.perf_counter() - started, 1))
        request = Generation("a red circle on a blue background", num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                             height=resolution, width=resolution)
        plain = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16, **families.absent_parts(folder)).to("cuda")
        plain.set_progress_bar_config(disable=True)
        # the guidance the server gives the same request: a Flux transformer without guidance embeddings that learned
        # the unconditional (its record) guides by true CFG, only with a negative prompt and `true_cfg_scale` given
        # (its transformer run twice a step, as ours)
        families.note_training(plain.transformer, families.saved_record(folder))
        options = families.sampling_options(plain, GUIDANCE)
        negative = families.negative_prompt(plain, None)
        plain_times = timed(lambda: plain(request.prompt, negative_prompt=negative, num_inference_steps=STEPS,
                                          guidance_scale=GUIDANCE, height=resolution, width=resolution,
                                          generator=torch.Generator("cpu").manual_seed(0), **options),
                            args.requests)
        del plain
        torch.cuda.empty_cache()
        progress(event="plain", resolution=resolution, p50=statistics.median(plain_times))
        started = time.perf_counter()
        ours = load_pipeline(folder, ServeSettings())
        cold = time.perf_counter() - started
        ours_times = timed(lambda: generate(ours, request), args.requests)
        del ours
        torch.cuda.empty_cache()
        torch._dynamo.reset()
        p50_plain, p50_ours = statistics.median(plain_times), statistics.median(ours_times)
        emit({"metric": f"serve.p50_latency_s_dit_{resolution}", "value": round(p50_ours, 4), "unit": "s",
              "baseline_p50_s": round(p50_plain, 4), "cold_start_s": round(cold, 1), "t5_layers": args.t5_layers,
              "true_cfg": bool(options.get("true_cfg_scale"))})
        emit({"metric": "serve.ratio_vs_diffusers_dit", "value": round(p50_plain / p50_ours, 3), "unit": "x",
              "resolution": resolution, "baseline": "DiffusionPipeline bf16, no compile"})


if __name__ == "__main__":
    main()
