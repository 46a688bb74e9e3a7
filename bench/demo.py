"""Benchmark `demo.upload_to_image_s` and `demo.prompt_match_rate`: a fresh local stack, the demo
catalogue uploaded, the time until the endpoint has drawn the image, and the share of the demo's
prompts whose pictures show the prompt's colours; with --grid also `demo.prompt_match_grid`, the share
of the whole catalogue grid (every shape x foreground x background, two seeds) drawn with the prompt's
colours and shape (atelier/prompt_match.py). Prints one JSON line per figure.

    .venv/bin/python bench/demo.py [--images 252] [--grid]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from importlib.metadata import version
from pathlib import Path

from atelier.demo import DemoOptions, run_demo

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=DemoOptions.images)
    parser.add_argument("--grid", action="store_true", help="also score the whole catalogue grid")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        lines = run_demo(DemoOptions(root=REPO, state_dir=Path(state), output=Path(state) / "image.png",
                                     images=args.images, grid=args.grid))
    upload = next(line for line in lines if line["metric"] == "demo.upload_to_image_s")
    upload["config"] = {"images": args.images, "jobs": len([j for j in upload["config"]["jobs"] if j["role"] == "train"])}
    for line in lines:
        line["machine"] = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": None}
        line["versions"] = {p: version(p) for p in ("torch", "diffusers", "moto", "aws-lambda-powertools")}
        print(json.dumps(line))


if __name__ == "__main__":
    main()
