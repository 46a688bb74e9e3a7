"""The transformer presets' training step on one GPU: img/s, MFU and peak memory, one JSON line per configuration.

    PYTHONUNBUFFERED=1 python bench/train_transformers.py --configs sd3m256,sd3m512,pixart512,flux512+lora+bf16base

What runs: the preset's transformer (trainer/configs/<preset>.json) with random weights, in fp32 with bf16
autocast, fused AdamW, gradient clipping; the flow-matching loss of trainer.objectives.flow_matching
(logit-normal timesteps shifted for the resolution, velocity target); latents and text embeddings
already on the GPU ("precomputed text embeddings", as the issue's anchors and MLPerf's Flux.1 run):
SD3: [batch, 77 + 256, 4096] context and [batch, 2048] pooled; PixArt: [batch, 300, 4096] context with
its attention mask (a caption of 60 tokens, as the mask a real T5 caption gives); Flux: [batch, 512, 4096]
T5 context and [batch, 768] pooled CLIP-L, its 16-channel latents packed as the trainer packs them. The
bound of the latent-shard path: no loader, no VAE.

FLOPs: torch.utils.flop_counter.FlopCounterMode over one eager forward + backward of one image
(attention included), times img/s, over 989e12 (H200 dense bf16) for MFU.

Configurations: `<preset><res>` (sd3m, pixart, flux: FLUX.1's 11.9 B layout, whose full training needs more than
one GPU, so only with `lora`) at the batch of `--batch` (default: the anchors'),
levers joined with `+`: `compile` (torch.compile of the transformer), `rcompile` (regional compilation: each
repeated block compiled in place, trainer/speed/regional_compile.py), `b<N>`, `fp8` (torchao float8
training on the transformer's linears with dims multiple of 16), `cudnnattn` (SDPA on cuDNN's
attention kernels), `bf16w` (bf16 weights with fp32 masters: trainer's master_weights), `ckpt`
(gradient checkpointing), `lora` (the base frozen, a rank-4 adapter on the trainer's targets, trainer/models/lora.py;
`r<N>` another rank), `bf16base` (with `lora`: the frozen base in bf16, as a GPU LoRA job keeps it, against fp32).
`--fixed-name METRIC=CONFIG` also prints CONFIG's line under the protocol's fixed name METRIC.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "functions")]  # a script: the repo's trainer and bench packages
PEAK_BF16 = 989e12
ANCHOR_BATCH = {("sd3m", 256): 64, ("sd3m", 512): 16, ("pixart", 512): 32, ("sd3m", 1024): 4, ("pixart", 1024): 8,
                ("pixart", 256): 128, ("flux", 512): 2, ("flux", 1024): 1}
PRESETS = {"sd3m": "sd3-medium", "pixart": "pixart-sigma", "flux": "flux1"}
LORA_RANK = 4  # the recipe's default --lora-rank (functions/contracts/recipe.py)


def progress(**fields):
    print(json.dumps({"progress": True, **fields}), file=sys.stderr, flush=True)


def build(preset_name: str, device, dtype=torch.float32):
    from bench.building import drawn_in
    from trainer.models.families import family_named, new_transformer
    preset = json.loads((CONFIGS / f"{preset_name}.json").read_text())
    family = family_named(preset["family"])
    torch.manual_seed(0)
    with drawn_in(dtype), torch.device(device):  # the dtype it trains in: FLUX.1's 11.9 B would not fit twice
        model = new_transformer(family, preset["transformer"])
    return family, preset, model


def adapted(model, family_name: str, rank: int) -> None:
    """The trainer's LoRA: the base frozen (in the dtype it was built in), a gaussian-initialised adapter in fp32."""
    from trainer.models.lora import add_adapter, config_for
    add_adapter(model, config_for(family_name, rank), seed=0, frozen=next(model.parameters()).dtype)


def inputs(family, model, preset: dict, batch: int, resolution: int, device):
    """Latents and precomputed text conditioning on the GPU, marked with how the model reads them (families.layout)."""
    from trainer.models.families import Conditioning, layout
    channels = preset["transformer"]["in_channels"] // (4 if family.packs_latents else 1)  # 2x2 latent pixels a token
    latents = torch.randn(batch, channels, resolution // 8, resolution // 8, device=device)
    if family.packs_latents:
        widths = preset["transformer"]["joint_attention_dim"], preset["transformer"]["pooled_projection_dim"]
        conditioning = Conditioning(torch.randn(batch, family.max_length, widths[0], device=device, dtype=torch.bfloat16),
                                    pooled=torch.randn(batch, widths[1], device=device, dtype=torch.bfloat16))
    elif family.name == "sd3":
        conditioning = Conditioning(torch.randn(batch, 77 + 256, 4096, device=device, dtype=torch.bfloat16),
                                    pooled=torch.randn(batch, 2048, device=device, dtype=torch.bfloat16))
    else:
        mask = torch.zeros(batch, 300, device=device, dtype=torch.long)
        mask[:, :60] = 1
        conditioning = Conditioning(torch.randn(batch, 300, 4096, device=device, dtype=torch.bfloat16), mask=mask)
    return latents, layout(family, model, conditioning)


def loss_of(step_model, latents, conditioning, settings, resolution, generator):
    from trainer.objectives.flow_matching import noised, sample_timesteps
    t = sample_timesteps(settings, latents.shape[0], resolution, latents.device, generator)
    noise = torch.randn(latents.shape, device=latents.device, generator=generator)
    noisy, target = noised(latents, noise, t)
    from trainer.models.families import predict
    with torch.autocast(latents.device.type, dtype=torch.bfloat16):
        prediction = predict(step_model, noisy, t, conditioning)
    return torch.nn.functional.mse_loss(prediction.float(), target.float())


def count_flops(model, family, preset, resolution, settings, device) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    latents, conditioning = inputs(family, model, preset, 1, resolution, device)
    generator = torch.Generator(device).manual_seed(0)
    counter = FlopCounterMode(display=False)
    from trainer.models.families import training_attention
    with counter, training_attention(family):  # Flux's backward faults on the default backend (families.py)
        loss_of(model, latents, conditioning, settings, resolution, generator).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def fp8_linears(model) -> int:
    from torchao.float8 import convert_to_float8_training
    converted = []

    def keep(module, name):
        ok = isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        if ok:
            converted.append(name)
        return ok
    convert_to_float8_training(model, module_filter_fn=keep)
    return len(converted)


def run(config: str, args, device, flops_cache: dict) -> dict:
    from trainer.objectives.flow_matching import FlowSettings
    head, *levers = config.split("+")
    name = next(prefix for prefix in PRESETS if head.startswith(prefix))
    resolution = int(head[len(name):])
    batch = ANCHOR_BATCH.get((name, resolution), 8)
    for lever in levers:
        if lever.startswith("b") and lever[1:].isdigit():
            batch = int(lever[1:])
    lora = "lora" in levers
    rank = next((int(lever[1:]) for lever in levers if lever.startswith("r") and lever[1:].isdigit()), LORA_RANK)
    if "bf16base" in levers and not lora or lora and "bf16w" in levers:
        raise ValueError(f"{config}: bf16base goes with lora (it is the frozen base's dtype), bf16w without it")
    family, preset, model = build(PRESETS[name], device, torch.bfloat16 if "bf16base" in levers else torch.float32)
    settings = FlowSettings.from_preset(preset.get("flow"))
    params = sum(p.numel() for p in model.parameters())
    if lora:
        adapted(model, family.name, rank)
    key = (name, resolution, rank if lora else None)  # an adapter's backward computes no frozen weight's gradient
    if key not in flops_cache:
        flops_cache[key] = count_flops(model, family, preset, resolution, settings, device)
    if "ckpt" in levers:
        model.enable_gradient_checkpointing()
    fp8_count = fp8_linears(model) if "fp8" in levers else 0
    masters = None
    trained = [p for p in model.parameters() if p.requires_grad]
    if "bf16w" in levers:
        masters = [p.detach().clone().float() for p in trained]
        model.to(torch.bfloat16)
        trained = list(model.parameters())
    optimizer = torch.optim.AdamW(masters or trained, lr=1e-4, fused=True)
    step_model = torch.compile(model, dynamic=False) if "compile" in levers else model
    if "rcompile" in levers:
        from trainer.speed.regional_compile import compile_regions
        compile_regions(model, family.name)
    from trainer.models.families import training_attention
    attention = training_attention(family)  # forward and backward on the family's kernels, as train_step runs them
    if "cudnnattn" in levers:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attention = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    latents, conditioning = inputs(family, model, preset, batch, resolution, device)
    generator = torch.Generator(device).manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    start_all = time.perf_counter()
    with attention:
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            loss = loss_of(step_model, latents, conditioning, settings, resolution, generator)
            loss.backward()
            if masters:
                for master, param in zip(masters, trained):
                    master.grad = param.grad.float()
                    param.grad = None
            torch.nn.utils.clip_grad_norm_(masters or trained, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if masters:
                with torch.no_grad():
                    for master, param in zip(masters, trained):
                        param.copy_(master)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            losses.append(loss.item())
            if step == 0:
                progress(config=config, first_step_s=round(times[0], 1))
    timed = sorted(times[args.warmup:])
    median = timed[len(timed) // 2]
    img_per_s = batch / median
    flops = flops_cache[key]
    line = {"metric": f"train.transformer.{config}", "value": round(img_per_s, 2), "unit": "img/s",
            "config": config, "batch": batch, "resolution": resolution, "params_b": round(params / 1e9, 3),
            "trained_params_m": round(sum(p.numel() for p in trained) / 1e6, 2), "lora_rank": rank if lora else None,
            "tflop_per_image": round(flops / 1e12, 3), "mfu": round(flops * img_per_s / PEAK_BF16, 4),
            "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "first_step_s": round(times[0], 1), "step_s_median": round(median, 4), "fp8_linears": fp8_count,
            "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
            "total_s": round(time.perf_counter() - start_all, 1)}
    del step_model, model, optimizer, masters, trained
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return line


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="sd3m256,sd3m256+compile,sd3m512,sd3m512+compile,pixart512,pixart512+compile")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fixed-name", action="append", default=[], metavar="METRIC=CONFIG",
                        help="also print CONFIG's line under the protocol's fixed metric name")
    args = parser.parse_args()
    fixed: dict[str, list[str]] = {}
    for metric, config in (pair.split("=", 1) for pair in args.fixed_name):
        if config not in args.configs.split(","):
            parser.error(f"--fixed-name {metric}={config}: {config} is not among --configs")
        fixed.setdefault(config, []).append(metric)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    from bench.stamp import commit
    base = {"commit": commit(), "machine": {"gpu": torch.cuda.get_device_name(), "nproc": os.cpu_count()},
            "versions": {"torch": torch.__version__}}
    flops_cache: dict = {}
    out = open(args.out, "a") if args.out else None
    for config in args.configs.split(","):
        try:
            line = {**run(config, args, device, flops_cache), **base}
        except Exception as error:  # one failing lever does not lose the lines after it
            line = {"metric": f"train.transformer.{config}", "error": f"{type(error).__name__}: {str(error)[:300]}", **base}
            torch.cuda.empty_cache()
        lines = [line] + [{**line, "metric": metric, "bench_metric": line["metric"]}
                          for metric in (fixed.get(config, []) if "error" not in line else [])]
        for each in lines:
            text = json.dumps(each)
            print(text, flush=True)
            if out:
                out.write(text + "\n")
                out.flush()


CONFIGS = ROOT / "trainer" / "configs"
if __name__ == "__main__":
    main()
