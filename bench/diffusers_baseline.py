"""The peer baseline: diffusers' examples/text_to_image/train_text_to_image.py, run unmodified.

    python bench/diffusers_baseline.py --script .peer/train_text_to_image.py --images /tmp/bench-folder \\
        --pipeline /tmp/sd2-random --ours $OUT/train.jsonl --out $OUT/train.jsonl

1. Writes a diffusers pipeline directory with random weights built from trainer/configs/<preset>.json
   (the same UNet, VAE and text-encoder configs the trainer builds) and a CLIP BPE tokenizer built
   locally (byte-level vocabulary, no merges, model_max_length=77: the script pads to it).
2. Runs the script (fetched from github.com/huggingface/diffusers, never committed here) on the same
   JPEGs as an imagefolder (bench/train_shards.py --imagefolder), same resolution, batch, bf16, EMA,
   centre crop; stamps each progress-bar step with the wall clock (the script prints no img/s),
   and stops it after --steps steps (before its final pipeline save).
3. Prints `train.diffusers_img_per_s_512` and, from our line in --ours, the ratio, named by the shards ours
   read (bench/metric_definitions.py): `train.ratio_vs_diffusers_512` on image shards (the VAE online, as the
   script), `train.ratio_vs_diffusers_512_latent` on latent shards (`--ours-source latent`).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.metric_definitions import shard_kind  # noqa: E402  (ROOT on the path first, as a script)


def clip_tokenizer(directory: Path):
    """A CLIP tokenizer over CLIP's byte-level alphabet with no merges (random weights need no real vocabulary)."""
    from transformers import CLIPTokenizer
    directory.mkdir(parents=True, exist_ok=True)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    symbols = [chr(b) for b in printable] + [chr(256 + n) for n in range(256 - len(printable))]  # GPT-2/CLIP byte alphabet
    vocab = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=77)


def build_pipeline_dir(preset_name: str, directory: Path, seed: int) -> None:
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from trainer.models.loading import read_preset
    preset = read_preset(preset_name)
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer(directory / "_vocab")
    text_encoder = CLIPTextModel(CLIPTextConfig(**preset["text_encoder"], vocab_size=len(tokenizer),
                                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id))
    pipeline = StableDiffusionPipeline(
        vae=AutoencoderKL(**preset["vae"]), text_encoder=text_encoder, tokenizer=tokenizer,
        unet=UNet2DConditionModel(**preset["unet"]), scheduler=DDPMScheduler(**preset["scheduler"]),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipeline.save_pretrained(directory)


def run_peer(args) -> dict:
    command = [sys.executable, args.script, "--pretrained_model_name_or_path", args.pipeline,
               "--train_data_dir", args.images, "--image_column", "image", "--caption_column", "text",
               "--resolution", str(args.resolution), "--center_crop", "--train_batch_size", str(args.batch),
               "--max_train_steps", str(args.steps + 5), "--learning_rate", "1e-4", "--max_grad_norm", "1",
               "--mixed_precision", "bf16", "--use_ema", "--foreach_ema",
               "--dataloader_num_workers", str(args.num_workers), "--output_dir", args.output_dir,
               "--checkpointing_steps", "1000000", "--seed", "0"]
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen: dict[int, float] = {}
    pattern = re.compile(rb"Steps:\s+\d+%.*?\|\s*(\d+)/(\d+)")
    tail, log = b"", open(args.log, "wb") if args.log else None
    while True:
        chunk = process.stdout.read1(65536)
        if not chunk:
            break
        now = time.time()
        if log:
            log.write(chunk)
        tail = (tail + chunk)[-4096:]
        for match in pattern.finditer(chunk):
            step = int(match.group(1))
            if step not in seen and step == 1:
                print(json.dumps({"progress": True, "peer_first_step_s": round(now - started, 1)}), file=sys.stderr, flush=True)
            seen.setdefault(step, now)
        if seen and max(seen) >= args.steps:
            process.terminate()  # measured enough; skip its final save
            break
    process.wait(timeout=60)
    if not seen or max(seen) < args.steps:
        raise RuntimeError(f"the peer script stopped before {args.steps} steps; output tail:\n{tail.decode(errors='replace')}")
    steps = sorted(s for s in seen if s > args.warmup)
    intervals = [(seen[b] - seen[a]) / (b - a) for a, b in zip(steps, steps[1:])]
    median = statistics.median(intervals)
    mean = (seen[steps[-1]] - seen[steps[0]]) / (steps[-1] - steps[0])
    return {"img_per_s": round(args.batch / median, 2), "img_per_s_window_mean": round(args.batch / mean, 2),
            "median_step_s": round(median, 4), "timed_steps": steps[-1] - steps[0], "warmup_steps": args.warmup,
            "first_step_s": round(seen[1] - started, 1) if 1 in seen else None}


def ratio_line(ours: dict, peer: dict, resolution: int, batch: int, script: str, encode: float | None) -> dict:
    """Ours / the script, named by the shards ours read: `_<res>` on image shards (the VAE online, as the
    script does: the fixed name's definition), `_<res>_latent` on latent shards, with what the encode costs."""
    kind = shard_kind(ours["config"].get("source"), ours["config"].get("name"))
    if kind not in ("image", "latent"):
        raise SystemExit(f"our line {ours['metric']} read neither image nor latent shards: no ratio name fits it")
    extra = {"goal": 2.0} if kind == "image" else {}  # BENCHMARKS.md: a goal on image shards, a record on latents
    if kind == "latent" and encode:
        # the encode job runs once per shard and resolution; each epoch after it trains on latents alone
        extra = {"encode_img_per_s": encode, "ratio_with_encode_per_epochs": {
            str(epochs): round(1 / (1 / ours["value"] + 1 / (encode * epochs)) / peer["img_per_s"], 3)
            for epochs in (1, 4, 10)}}
    return {"metric": f"train.ratio_vs_diffusers_{resolution}" + ("_latent" if kind == "latent" else ""),
            "value": round(ours["value"] / peer["img_per_s"], 3), "unit": "ratio", "ours_img_per_s": ours["value"],
            "baseline_img_per_s": peer["img_per_s"],
            "ratio_window_means": round(ours["config"]["img_per_s_window_mean"] / peer["img_per_s_window_mean"], 3),
            "baseline": script, **extra,
            "config": {"resolution": resolution, "batch": batch, "ours": ours["config"]["name"],
                       "ours_source": ours["config"].get("source", kind), "ours_batch": ours["config"].get("batch"),
                       "same_images": True, "same_lease": True}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", required=True)
    parser.add_argument("--images", required=True, help="imagefolder with metadata.jsonl (file_name, text)")
    parser.add_argument("--pipeline", default="/tmp/sd2-random")
    parser.add_argument("--model-config", default="sd2")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--output-dir", default="/tmp/peer-out")
    parser.add_argument("--ours", default=None, help="bench/train_throughput.py's JSON lines, for the ratio")
    parser.add_argument("--ours-source", choices=("image", "latent"), default="image",
                        help="which of our lines the ratio uses: image shards (VAE online) or latent shards "
                             "encoded from the same images (the encode job's img/s is reported beside it)")
    parser.add_argument("--log", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from bench.stamp import commit, versions
    from bench.train_figures import UNET_TFLOP
    made = time.time()
    if not (Path(args.pipeline) / "model_index.json").is_file():
        build_pipeline_dir(args.model_config, Path(args.pipeline), 0)
    print(json.dumps({"progress": True, "pipeline_dir_s": round(time.time() - made, 1)}), file=sys.stderr, flush=True)
    result = run_peer(args)

    import torch
    common = {"commit": commit(), "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                              "nproc": os.cpu_count()}, "versions": versions()}
    peer = {"script": "diffusers examples/text_to_image/train_text_to_image.py, unmodified",
            "flags": "bf16, --use_ema --foreach_ema, --center_crop, lr 1e-4, max_grad_norm 1, "
                     f"{args.num_workers} loader workers, random-weight {args.model_config} pipeline built from trainer/configs"}
    lines = [{"metric": f"train.diffusers_img_per_s_{args.resolution}", "value": result["img_per_s"], "unit": "img/s",
              "mfu_989": round(result["img_per_s"] * UNET_TFLOP[args.resolution] / 989, 4),
              "config": {**peer, "batch": args.batch, "resolution": args.resolution, **result}, **common}]
    ours, encode = None, None
    if args.ours and Path(args.ours).is_file():
        for text in Path(args.ours).read_text().splitlines():
            line = json.loads(text)
            if line.get("metric") == f"train.img_per_s_{args.resolution}_{args.ours_source}":
                ours = line
            if line.get("metric") == f"train.encode_img_per_s_{args.resolution}":
                encode = line["value"]
    if ours:
        lines.append({**ratio_line(ours, result, args.resolution, args.batch, peer["script"], encode), **common})
    for line in lines:
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
