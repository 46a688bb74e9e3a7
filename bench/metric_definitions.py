"""Whether a result line measured what its metric's name promises (shared/BENCHMARKS.md's fixed names).

Some fixed names define the configuration as well as the figure: `demo.prompt_match_grid` is the shipped
recipe's model (a variant's line is `demo.prompt_match_grid_variant`); `train.ratio_vs_diffusers_512` is ours on
image shards (the VAE online) against the diffusers script, `train.ratio_vs_diffusers_512_latent` ours on
latent shards; `train.img_per_s_512_latent` is the SD-2-size UNet at 512 px on latent shards on one H200.
A line under such a name whose configuration says otherwise is mislabeled: its figure belongs to another
name. `problems(line)` says what does not match; `python bench/metric_definitions.py [bench/RESULTS.md]`
checks every JSON line in RESULTS.md's code blocks and exits 1 on a mislabeled line it does not know.

RESULTS.md rows are never edited, so the rows recorded mislabeled before this check are listed in
KNOWN_MISLABELED by the date of their section, with the name each should have had (RESULTS.md's last
section says the same).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


@dataclass(frozen=True)
class Definition:
    """What a fixed name fixes of the configuration; None: that part is free."""
    shards: str  # "image" (the VAE online) or "latent" (trainer/jobs/encode.py's latent shards)
    resolution: int
    model_config: str | None = None  # the preset whose UNet size the name states
    gpu: str | None = None  # a part of the GPU's name


DEFINITIONS = {
    "train.ratio_vs_diffusers_512": Definition("image", 512),
    "train.ratio_vs_diffusers_512_latent": Definition("latent", 512),
    "train.img_per_s_512_latent": Definition("latent", 512, "sd2", "H200"),
    "train.img_per_s_256_latent": Definition("latent", 256, "sd2", "H200"),
    "train.img_per_s_512_image": Definition("image", 512, "sd2", "H200"),
    "train.img_per_s_1024_latent": Definition("latent", 1024, "sdxl", "H200"),
}

# (section date, metric, value) -> the name the row should have had
KNOWN_MISLABELED = {
    # unet-only rows, random latents resident on the GPU: no shards at all (bench/train_configs.py's `resident` source)
    ("2026-11-29", "train.img_per_s_512_latent", 96.23): "train.config.resident512",
    ("2026-11-29", "train.img_per_s_256_latent", 382.95): "train.config.resident256",
    ("2026-11-29", "train.img_per_s_256_latent", 384.45): "train.config.resident256",
    ("2026-11-29", "train.img_per_s_512_latent", 93.95): "train.config.resident512",
    # ours on latent shards against the script (bench/diffusers_baseline.py --ours-source latent)
    ("2026-11-29", "train.ratio_vs_diffusers_512", 2.32): "train.ratio_vs_diffusers_512_latent",
    # variants of the demo's recipe (bench/demo_recipe.py --variant) before it named them apart; untrained: 0.009
    ("2026-12-05", "demo.prompt_match_grid", 0.878): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.8): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.761): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.706): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.65): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.633): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.606): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.467): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.458): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.433): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.406): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.383): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.278): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.044): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.022): "demo.prompt_match_grid_variant",
    ("2026-12-05", "demo.prompt_match_grid", 0.009): "demo.prompt_match_grid_variant",
}


def shard_kind(source: str | None, name: str | None) -> str | None:
    """"image", "latent" or None (neither, e.g. latents resident on the GPU) from a configuration's `source`,
    else from its name's first part (bench/train_configs.py names configurations `<source><resolution>+...`)."""
    if source:
        return "latent" if source.startswith("latent shards") else "image" if source.startswith("image") else None
    prefix = re.match(r"[a-z]+", name or "")
    return prefix.group(0) if prefix and prefix.group(0) in ("image", "latent") else None


def stated_resolution(config: dict) -> int | None:
    """The configuration's `resolution`, else the one in its name (`latent1024+compile`), else None."""
    if config.get("resolution") is not None:
        return config["resolution"]
    found = re.match(r"[a-z]+(\d+)", config.get("ours") or config.get("name") or "")
    return int(found.group(1)) if found else None


def problems(line: dict) -> list[str]:
    """What in the line's configuration contradicts its metric's definition ([] if nothing, or no definition)."""
    config = line.get("config") if isinstance(line.get("config"), dict) else {}
    if line.get("metric") == "demo.prompt_match_grid":  # the demo's model: the shipped recipe, not a variant of it
        variant = config.get("variant", "shipped")
        return [] if variant == "shipped" else [f"the recipe's variant {variant!r}, defined for the shipped recipe"]
    definition = DEFINITIONS.get(line.get("metric", ""))
    if definition is None:
        return []
    found = []
    kind = shard_kind(config.get("ours_source") or config.get("source"), config.get("ours") or config.get("name"))
    if kind != definition.shards:
        found.append(f"measured on {kind or 'neither image nor latent'} shards, defined on {definition.shards} shards")
    if stated_resolution(config) != definition.resolution:
        found.append(f"resolution {stated_resolution(config)}, defined at {definition.resolution}")
    model = line.get("model_config")
    if definition.model_config and model is not None and model != definition.model_config:
        found.append(f"model_config {model!r}, defined for {definition.model_config!r}")
    gpu = (line.get("machine") or {}).get("gpu")
    if definition.gpu and gpu is not None and definition.gpu not in gpu:
        found.append(f"GPU {gpu!r}, defined on one {definition.gpu}")
    return found


def result_rows(path: Path = RESULTS) -> list[tuple[str, dict]]:
    """(date of its section, line) for every JSON line inside RESULTS.md's code blocks."""
    rows, date, in_block = [], "", False
    for text in path.read_text().splitlines():
        if text.startswith("```"):
            in_block = not in_block
        elif in_block and text.startswith("{"):
            try:
                rows.append((date, json.loads(text)))
            except ValueError:
                continue  # a line cut short in the record: no metric to check
        elif not in_block and text.startswith("## "):
            found = re.search(r"\d{4}-\d{2}-\d{2}", text)
            date = found.group(0) if found else ""
    return rows


def mislabeled(path: Path = RESULTS) -> dict[tuple[str, str, float], list[str]]:
    """Every row of the file whose configuration contradicts its name, by (date, metric, value)."""
    return {(date, line["metric"], line.get("value")): found
            for date, line in result_rows(path) if (found := problems(line))}


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else RESULTS
    unknown = {row: found for row, found in mislabeled(path).items() if row not in KNOWN_MISLABELED}
    for (date, metric, value), found in unknown.items():
        print(f"{path}: {date} {metric} = {value}: {'; '.join(found)}")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
