"""The fastest measured configuration per (model preset, resolution): configs/defaults/fast.json.

`trainer.jobs.train --compile auto` (the default) compiles where the table says compiling pays, and
`--cuda-graphs auto` replays the step from CUDA graphs where the table says that pays, on a GPU
only: Inductor on a CPU costs minutes and gains nothing the tests or a CPU smoke run need. The
table's batch and accumulation are what template.yaml's default run plan uses (a test holds them
together), so the job a user gets by default is the one the table's figure measured.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TABLE = CONFIGS / "defaults" / "fast.json"
# config keys that size or place positions, add the guidance embedder or a learned variance's output channels, and
# leave the blocks' work as it was: FLUX.1-dev's guidance_embeds, PixArt-Sigma's 8 output channels
NOT_ARCHITECTURE = frozenset({"sample_size", "pos_embed_max_size", "interpolation_scale", "guidance_embeds",
                              "out_channels"})


@dataclass(frozen=True)
class FastConfig:
    preset: str
    resolution: int
    compile: bool
    fused_adamw: bool
    batch_size: int
    gradient_accumulation: int
    measured: dict
    cuda_graphs: bool = False  # trainer/speed/cuda_graphs.py: on where it was measured faster


@cache
def table() -> dict[tuple[str, int], FastConfig]:
    entries = json.loads(TABLE.read_text())["entries"]
    return {(entry["preset"], entry["resolution"]): FastConfig(**entry) for entry in entries}


def lookup(preset: str, resolution: int) -> FastConfig | None:
    return table().get((preset, resolution))


def measured_preset(model_config: str, denoiser_class: str, denoiser_config: Mapping, from_base: bool) -> str | None:
    """The preset whose rows of the table speak for a run's denoiser: --model-config when the job built the denoiser
    from it; for a denoiser from a --pretrained base, the table's preset of the same architecture (the same class,
    and the same config on every constructor argument but NOT_ARCHITECTURE, an argument the preset leaves out taken
    at the class's default), else None (eager, as an unmeasured preset). A base's model is what runs, whatever
    --model-config says: an SD3-medium or FLUX.1 base trained eager under `--compile auto` while --model-config kept
    its default, tiny. SD3.5-medium's blocks (query-key norms, dual attention) are not SD3-medium's: no row."""
    if not from_base:
        return model_config
    return next((preset for preset in sorted({entry.preset for entry in table().values()})
                 if _same_architecture(json.loads((CONFIGS / f"{preset}.json").read_text()), denoiser_class,
                                       denoiser_config)), None)


def _same_architecture(preset: dict, denoiser_class: str, config: Mapping) -> bool:
    from diffusers import UNet2DConditionModel  # torch and diffusers, loaded late: the table is read without them
    from trainer.models.families import family_named
    model_class = family_named(preset["family"]).transformer_class if "transformer" in preset else UNet2DConditionModel
    if denoiser_class != model_class.__name__:
        return False
    defaults = {name: parameter.default for name, parameter in inspect.signature(model_class.__init__).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    wanted = {**defaults, **(preset.get("transformer") or preset["unet"])}
    return all(_same(config.get(key, defaults.get(key)), value) for key, value in wanted.items()
               if key not in NOT_ARCHITECTURE)


def _same(given, preset_value) -> bool:
    """Equal as JSON gives them: a saved config's tuples are the preset's lists."""
    return json.loads(json.dumps(given)) == json.loads(json.dumps(preset_value))


def compile_by_default(preset: str, resolutions: list[int], on_gpu: bool) -> bool:
    """`--compile auto`: on a GPU, when the table measured compiling faster at every phase's resolution."""
    return on_gpu and _measured_faster_everywhere(preset, resolutions, "compile")


def graphs_by_default(preset: str, resolutions: list[int]) -> bool:
    """`--cuda-graphs auto` (where they can run): when the table measured them faster at every phase's resolution."""
    return _measured_faster_everywhere(preset, resolutions, "cuda_graphs")


def _measured_faster_everywhere(preset: str, resolutions: list[int], lever: str) -> bool:
    entries = [lookup(preset, resolution) for resolution in resolutions]
    return bool(entries) and all(entry is not None and getattr(entry, lever) for entry in entries)
