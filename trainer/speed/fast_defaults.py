"""The fastest measured configuration per (model preset, resolution): configs/defaults/fast.json.

`trainer.jobs.train --compile auto` (the default) compiles where the table says compiling pays, and
`--cuda-graphs auto` replays the step from CUDA graphs where the table says that pays, on a GPU
only: Inductor on a CPU costs minutes and gains nothing the tests or a CPU smoke run need. The
table's batch and accumulation are what template.yaml's default run plan uses (a test holds them
together), so the job a user gets by default is the one the table's figure measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "configs" / "defaults" / "fast.json"


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


def compile_by_default(preset: str, resolutions: list[int], on_gpu: bool) -> bool:
    """`--compile auto`: on a GPU, when the table measured compiling faster at every phase's resolution."""
    return on_gpu and _measured_faster_everywhere(preset, resolutions, "compile")


def graphs_by_default(preset: str, resolutions: list[int]) -> bool:
    """`--cuda-graphs auto` (where they can run): when the table measured them faster at every phase's resolution."""
    return _measured_faster_everywhere(preset, resolutions, "cuda_graphs")


def _measured_faster_everywhere(preset: str, resolutions: list[int], lever: str) -> bool:
    entries = [lookup(preset, resolution) for resolution in resolutions]
    return bool(entries) and all(entry is not None and getattr(entry, lever) for entry in entries)
