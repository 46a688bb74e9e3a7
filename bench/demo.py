"""Benchmark `demo.upload_to_image_s`: a fresh local stack, the demo catalog uploaded, time until
the endpoint has drawn the image. Prints one JSON line.

    .venv/bin/python bench/demo.py [--images 16]
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
    parser.add_argument("--images", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        result = run_demo(DemoOptions(root=REPO, state_dir=Path(state), output=Path(state) / "image.png",
                                      images=args.images))
    result["config"] = {"images": args.images, "jobs": len([j for j in result["config"]["jobs"] if j["role"] == "train"])}
    result["machine"] = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "gpu": None}
    result["versions"] = {p: version(p) for p in ("torch", "diffusers", "moto", "aws-lambda-powertools")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
