"""Benchmark `demo.upload_to_image_s` and `demo.prompt_match_rate`: a fresh local stack, the demo
catalogue uploaded, the time until the endpoint has drawn the image, and the share of the demo's
prompts whose pictures show the prompt's colours. Prints one JSON line per figure.

    .venv/bin/python bench/demo.py [--images 168]
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        lines = run_demo(DemoOptions(root=REPO, state_dir=Path(state), output=Path(state) / "image.png",
                                     images=args.images))
    lines[0]["config"] = {"images": args.images, "jobs": len([j for j in lines[0]["config"]["jobs"] if j["role"] == "train"])}
    for line in lines:
        line["machine"] = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": None}
        line["versions"] = {p: version(p) for p in ("torch", "diffusers", "moto", "aws-lambda-powertools")}
        print(json.dumps(line))


if __name__ == "__main__":
    main()
