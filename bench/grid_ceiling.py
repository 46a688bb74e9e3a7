"""The most a model can score on the catalogue grid through a VAE: how often the grid's classifier
(atelier/prompt_match.py, colours and shape) reads real catalogue pictures right, as drawn at --size px and
after a round trip through the VAE (encode, the latent's mode, decode). A diffusion model's picture is the
VAE's decode of a latent, so a VAE that loses a square's corners at the demo's size caps
`demo.prompt_match_grid` whatever the UNet learns. One JSON line:
`demo.grid_ceiling` (share through the VAE), with the raw pictures' share and the misses by drawn shape.

    .venv/bin/python bench/grid_ceiling.py --vae /tmp/demo-grid/vae --size 32 [--variants 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from atelier.catalog import COLOURS, SHAPES, picture  # noqa: E402
from atelier.prompt_match import picture_colours, picture_shape  # noqa: E402
from bench.stamp import commit  # noqa: E402
from trainer.jobs.autoencoder import reconstruct  # noqa: E402


def round_trip(vae, image: Image.Image) -> Image.Image:
    pixels = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)[None].float() / 127.5 - 1
    decoded = reconstruct(vae, pixels, torch.device("cpu"))[0]
    return Image.fromarray(((decoded.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vae", type=Path, required=True, help="an AutoencoderKL folder (the autoencoder job's model)")
    parser.add_argument("--size", type=int, default=32, help="the size pictures are scored at (the demo trains at 32)")
    parser.add_argument("--variants", type=int, default=2, help="jittered pictures per shape x colour x background")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    from diffusers import AutoencoderKL
    torch.set_num_threads(1)
    vae = AutoencoderKL.from_pretrained(args.vae).eval()
    jitter = random.Random(args.seed)
    raw = through = 0
    misses: Counter = Counter()
    combinations = [(shape, colour, ground) for shape in SHAPES for colour in COLOURS for ground in COLOURS if colour != ground]
    for shape, colour, ground in combinations:
        for _ in range(args.variants):
            # drawn at the catalogue's 64 px and resized, as the training pipeline resizes the shards' pictures
            image = picture(shape, colour, ground, size=64, jitter=jitter).resize((args.size, args.size), Image.BICUBIC)
            raw += picture_colours(image) == (colour, ground) and picture_shape(image) == shape
            decoded = round_trip(vae, image)
            colours, read = picture_colours(decoded), picture_shape(decoded)
            through += colours == (colour, ground) and read == shape
            if colours != (colour, ground) or read != shape:
                misses[f"{shape} read as {read}" + ("" if colours == (colour, ground) else f", colours {'/'.join(colours)}")] += 1
    count = len(combinations) * args.variants
    print(json.dumps({"metric": "demo.grid_ceiling", "value": round(through / count, 3), "unit": "share",
                      "raw": round(raw / count, 3), "pictures": count, "misses": dict(misses.most_common()),
                      "config": {"vae": str(args.vae), "size": args.size, "variants": args.variants, "seed": args.seed},
                      "commit": commit()}))


if __name__ == "__main__":
    main()
