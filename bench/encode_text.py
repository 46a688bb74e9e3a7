"""How fast the encode job turns captions into a transformer family's stored text embeddings, on this machine.

The encode job's own calls, per batch of captions, one after the other (the job overlaps the members with the
next batch on its writer thread): `trainer.jobs.encode.caption_embeddings` (the family pipeline's encode_prompt,
under the job's autocast, cut and cast to bf16 on the device), the copy to the host and
`trainer.data.latents.text_member` for each caption (cut after its mask), on the procedural catalogue's captions (atelier.catalog) with each preset's models
(random, seeded; tokenizers learned from those captions), on the GPU when there is one. Prints one JSON
line per figure and preset:
- encode.text_captions_per_s_<family>: captions a second through both, the median of --repeats rounds after
  a warm-up; `ratio_vs_encode_prompt`: that over encode_prompt alone on the same batches, timed in the same
  rounds (A B A B ...): what storing the members costs on top of the text encoders (the members' sizes are
  measured after the rounds, off the clock).
- encode.text_bytes_per_caption_<family>: the mean size of one caption's member; `ratio_vs_untrimmed`: that
  over the same tensors stored whole (what cutting the masked positions saves; 1.0 for SD3, which has no mask).

    .venv/bin/python bench/encode_text.py [--model-config tiny-sd3,tiny-pixart] [--captions 256] [--batch 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

import torch  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402

from atelier.catalog import caption_of, training_combinations  # noqa: E402
from bench.stamp import commit, versions  # noqa: E402
from trainer.data.latents import read_text, text_member  # noqa: E402
from trainer.jobs.encode import caption_conditioning, caption_embeddings  # noqa: E402
from trainer.models.loading import load_models  # noqa: E402


def captions_of(count: int) -> list[str]:
    """`count` catalogue captions, cycling through every shape x colour x background."""
    every = [caption_of(*combination) for combination in training_combinations()]
    return [every[number % len(every)] for number in range(count)]


def timed(work, device: torch.device) -> float:
    """Seconds `work()` takes, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def untrimmed_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """One caption's tensors stored whole, floating point in bf16."""
    return len(save_safetensors({name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
                                 for name, t in tensors.items()}))


def measure(preset: str, captions: list[str], batch: int, repeats: int, device: torch.device) -> list[dict]:
    models = load_models(preset, None, seed=0, captions=lambda: captions)
    models.frozen_to(device)
    batches = [captions[start:start + batch] for start in range(0, len(captions), batch)]

    def prompts_alone():
        for texts in batches:
            caption_conditioning(models, texts, device)

    def stored(members: list[bytes]):
        for texts in batches:
            tensors = {name: tensor.cpu() for name, tensor in caption_embeddings(models, texts, device).items()}
            for number in range(len(texts)):
                members.append(text_member({name: tensor[number] for name, tensor in tensors.items()}, "bench"))

    job_s, alone_s, members = [], [], []
    for round_number in range(repeats + 1):  # round 0 warms up
        members.clear()
        job, alone = timed(lambda: stored(members), device), timed(prompts_alone, device)
        if round_number:
            job_s.append(job)
            alone_s.append(alone)
    sizes = [(len(member), untrimmed_bytes(read_text(member))) for member in members]  # off the clock
    job_median, alone_median = statistics.median(job_s), statistics.median(alone_s)
    kept, whole = (statistics.mean(column) for column in zip(*sizes))
    common = {"commit": commit(), "versions": versions(),
              "machine": {"nproc": os.cpu_count(), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}}
    config = {"model_config": preset, "captions": len(captions), "batch": batch, "repeats": repeats, "statistic": "median",
              "device": device.type, "job_s": [round(s, 4) for s in job_s], "encode_prompt_s": [round(s, 4) for s in alone_s]}
    family = models.family.name
    return [{"metric": f"encode.text_captions_per_s_{family}", "value": round(len(captions) / job_median, 1),
             "unit": "captions/s", "ratio_vs_encode_prompt": round(alone_median / job_median, 3),
             "baseline": "encode_prompt alone, same batches, same rounds", "config": config, **common},
            {"metric": f"encode.text_bytes_per_caption_{family}", "value": round(kept), "unit": "bytes",
             "ratio_vs_untrimmed": round(kept / whole, 3), "baseline": "the same tensors stored whole",
             "config": {"model_config": preset, "captions": len(captions)}, **common}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="tiny-sd3,tiny-pixart", help="family presets, comma-separated")
    parser.add_argument("--captions", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="captions per encode_prompt call")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    captions = captions_of(args.captions)
    for preset in args.model_config.split(","):
        for line in measure(preset, captions, args.batch, args.repeats, device):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
