"""What a regionally compiled transformer pays for aspect buckets: compile seconds and img/s over several bucket shapes,
with each shape its own graph (`static`, dynamic=False), Dynamo's automatic dynamic shapes (`auto`, dynamic=None:
a shape's second graph is symbolic in the sizes that changed) and symbolic sizes from the first graph (`dynamic`).

    PYTHONUNBUFFERED=1 python bench/compile_shapes.py --preset sd3-medium --resolution 512 --shapes 6

What runs: the preset's transformer (trainer/configs/<preset>.json) with random weights, its repeated blocks compiled
in place (trainer/speed/regional_compile.py), fp32 weights under bf16 autocast, AdamW, the flow-matching loss, with
latents and text embeddings already on the device (as bench/train_transformers.py). The shapes are the phase's aspect
buckets (contracts.bucket_sizes) of distinct areas (a bucket's transpose makes as many tokens), the square first,
then spread over the wide ones. Each mode runs in a process of its own with an empty Inductor cache directory (no
mode compiles with kernels another compiled), with Dynamo's limits raised as the training job raises them: every
shape in turn, its first step timed (the compile it causes) and `--steps` more (the median is its speed); then every shape
once more, timed (a later visit that compiles again shows here). One JSON line per mode, then the ratios.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "functions")]  # a script: the repo's trainer and bench packages

MODES = {"static": False, "auto": None, "dynamic": True}


def spread_shapes(resolution: int, multiple: int, count: int) -> list[tuple[int, int]]:
    """`count` of the phase's (width, height) buckets of distinct areas: the square, then evenly over the wide ones.
    A bucket and its transpose give the blocks the same token count, so the same graphs: one of each pair is taken."""
    from contracts.bucket_sizes import bucket_sizes
    square = (resolution, resolution)
    wide = [size for size in bucket_sizes(resolution, multiple) if size[0] > size[1]]
    if count > len(wide) + 1:
        raise ValueError(f"resolution {resolution} has {len(wide) + 1} bucket areas, fewer than --shapes {count}")
    picked = [wide[round(i * (len(wide) - 1) / max(count - 2, 1))] for i in range(count - 1)]
    return [square, *dict.fromkeys(picked)]


def conditioning_for(family, model, preset: dict, batch: int, device):
    """Precomputed text conditioning at the preset's widths, marked with how the model reads it."""
    from trainer.models.families import Conditioning, layout
    config, bf16 = preset["transformer"], torch.bfloat16
    if family.name == "pixart":
        mask = torch.zeros(batch, family.max_length, device=device, dtype=torch.long)
        mask[:, :60] = 1  # a caption of 60 tokens
        return Conditioning(torch.randn(batch, family.max_length, config["caption_channels"], device=device, dtype=bf16),
                            mask=mask)
    tokens = family.max_length + (77 if family.name == "sd3" else 0)  # SD3: CLIP's 77 before T5's
    return layout(family, model, Conditioning(
        torch.randn(batch, tokens, config["joint_attention_dim"], device=device, dtype=bf16),
        pooled=torch.randn(batch, config["pooled_projection_dim"], device=device, dtype=bf16)))


def timed_step(model, optimizer, latents, conditioning, settings, resolution, generator, attention, device) -> float:
    from bench.train_transformers import loss_of
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    began = time.perf_counter()
    with attention:
        loss_of(model, latents, conditioning, settings, resolution, generator).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize()
    return time.perf_counter() - began


def run_mode(mode: str, args, device) -> dict:
    from bench.train_transformers import build
    from contracts.model_presets import SIZE_MULTIPLES, VAE_DOWNSAMPLING
    from trainer.models.families import training_attention
    from trainer.objectives.flow_matching import FlowSettings
    from trainer.speed.regional_compile import compile_regions
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    family, preset, model = build(args.preset, device)
    settings = FlowSettings.from_preset(preset.get("flow"))
    compile_regions(model, family.name, backend=args.backend, dynamic=MODES[mode])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    conditioning = conditioning_for(family, model, preset, args.batch, device)
    generator = torch.Generator(device).manual_seed(0)
    downsampling = VAE_DOWNSAMPLING[args.preset]
    channels = preset["transformer"]["in_channels"] // (4 if family.packs_latents else 1)
    shapes = spread_shapes(args.resolution, SIZE_MULTIPLES[args.preset], args.shapes)
    latents = {shape: torch.randn(args.batch, channels, shape[1] // downsampling, shape[0] // downsampling, device=device)
               for shape in shapes}
    attention = training_attention(family)
    step = lambda shape: timed_step(model, optimizer, latents[shape], conditioning, settings, args.resolution,  # noqa: E731
                                    generator, attention, device)
    per_shape, started = [], time.perf_counter()
    for shape in shapes:
        first = step(shape)
        times = sorted(step(shape) for _ in range(args.steps))
        per_shape.append({"shape": list(shape), "first_step_s": round(first, 2),
                          "img_per_s": round(args.batch / times[len(times) // 2], 2)})
        print(json.dumps({"progress": True, "mode": mode, **per_shape[-1]}), file=sys.stderr, flush=True)
    first_pass_s = time.perf_counter() - started
    revisit = [round(step(shape), 3) for shape in shapes]
    stats = torch._dynamo.utils.counters["stats"]
    steady = [entry["img_per_s"] for entry in per_shape]
    line = {"metric": f"train.compile_shapes_{mode}", "value": round(sum(e["first_step_s"] for e in per_shape), 1),
            "unit": "s", "what": "the first steps' seconds over the shapes (the compiles)",
            "img_per_s_mean": round(sum(steady) / len(steady), 2), "first_pass_s": round(first_pass_s, 1),
            "revisit_step_s": revisit, "graphs": stats.get("unique_graphs", 0), "per_shape": per_shape}
    del model, optimizer, latents
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return line


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="sd3-medium", help="a transformer preset of trainer/configs")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps a shape after its first")
    parser.add_argument("--modes", default="static,auto,dynamic")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (the CPU test: aot_eager)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one-mode", action="store_true", help=argparse.SUPPRESS)  # the child process of a mode
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if args.one_mode:
        print(json.dumps(measure_mode(modes[0], args)), flush=True)
        return []
    from bench.stamp import commit
    device = torch.device(args.device)
    base = {"commit": commit(), "config": {"preset": args.preset, "resolution": args.resolution, "shapes": args.shapes,
                                           "batch": args.batch, "steps": args.steps, "backend": args.backend},
            "machine": {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "nproc": os.cpu_count()},
            "versions": {"torch": torch.__version__}}
    lines = {mode: {**in_own_process(mode, argv if argv is not None else sys.argv[1:]), **base} for mode in modes}
    if "static" in lines:
        static = lines["static"]
        for mode in (mode for mode in modes if mode != "static"):
            lines[f"{mode}_ratio"] = {
                "metric": f"train.compile_shapes_{mode}_vs_static", "value": round(static["value"] / max(lines[mode]["value"], 1e-9), 3),
                "unit": "x", "what": "static's compile seconds over this mode's (above 1: this mode compiles quicker)",
                "img_per_s_ratio": round(lines[mode]["img_per_s_mean"] / static["img_per_s_mean"], 3), **base}
    out = open(args.out, "a") if args.out else None
    for line in lines.values():
        text = json.dumps(line)
        print(text, flush=True)
        if out:
            out.write(text + "\n")
    return list(lines.values())


def in_own_process(mode: str, argv: list[str]) -> dict:
    """One mode in a fresh process with an empty Inductor cache directory: no mode compiles with another's kernels
    (Triton's compiled kernels are cached on disk, under the cache directory, across processes)."""
    with tempfile.TemporaryDirectory(prefix=f"inductor-{mode}-") as cache:
        done = subprocess.run([sys.executable, __file__, *argv, "--modes", mode, "--one-mode"], check=True, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_mode(mode: str, args) -> dict:
    import torch._inductor.config as inductor
    inductor.fx_graph_cache = False  # a shape's graph compiled, never read back from this mode's own earlier graphs
    from trainer.speed.regional_compile import allow_graphs
    allow_graphs("regional", args.shapes)  # as trainer/jobs/train.py does for a run of this many bucket shapes
    return run_mode(mode, args, torch.device(args.device))


if __name__ == "__main__":
    main()
