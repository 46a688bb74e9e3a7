"""Progressive resolution: a run is a list of phases (resolution, batch size, learning rate, steps).

A run config is `configs/runs/<name>.json` (or a path to such a file):

    {"description": "...",
     "phases": [{"resolution": 256, "batch_size": 128, "learning_rate": 1e-4, "steps": 200000, "warmup_steps": 10000},
                {"resolution": 512, "batch_size": 32, "learning_rate": 1e-4, "steps": 100000}]}

Without one, `--steps`, `--batch-size`, `--resolution` and `--learning-rate` make a single phase.
Steps are counted over the whole run (1-based): the phase of a step, its learning rate and its data
are pure functions of the step, so a resumed job lands in the right phase with nothing else saved.
The learning rate warms up linearly over a phase's first `warmup_steps`, then stays constant, or,
with `final_lr_fraction` below 1, follows a cosine from there down to that fraction of itself at the
phase's last step (what a from-scratch run wants: the weights settle instead of wandering at full rate).

A plan may start after step 1 (`first_step`, the trainer's `--first-step`): the pipeline runs each job of
its run plan, and each later manifest of a lineage, as a job of its own that resumes the lineage's
checkpoints, and that job's phase warms up from its own first step, as a phase inside a run config does.

A run config written before phases had their name lists them under `"stages"`: read as `"phases"`
(RUN_CONFIG_ALIASES), so users' files keep working.
"""

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from contracts.recipe import Phase, first_error
from trainer.data.buckets import check_resolution

RUNS_DIR = Path(__file__).resolve().parents[1] / "configs" / "runs"
PHASE_FIELDS = set(Phase.model_fields)
RUN_CONFIG_ALIASES = {"stages": "phases"}  # older key -> its name now


@dataclass(frozen=True)
class PlacedPhase:
    """A run config's phase (contracts.recipe.Phase, where its fields are typed and checked), placed in its run."""

    resolution: int
    batch_size: int  # images per micro-batch per process
    learning_rate: float
    steps: int
    warmup_steps: int = 0
    final_lr_fraction: float = 1.0  # 1: constant after warm-up; below 1: a cosine down to this share
    first_step: int = 1  # the run's step number of this phase's first step


class RunPlan:
    """The phases of a run, placed end to end."""

    def __init__(self, phases: list[dict], first_step: int = 1, size_multiple: int = 1):
        if not phases:
            raise ValueError("a run config needs at least one phase")
        if first_step < 1:
            raise ValueError(f"the first step is step 1 or later, got {first_step}")
        self.phases: list[PlacedPhase] = []
        first = first_step
        for number, fields in enumerate(phases):
            unknown = set(fields) - PHASE_FIELDS
            if unknown:
                raise ValueError(f"phase {number}: unknown fields {sorted(unknown)}; a phase has {sorted(PHASE_FIELDS)}")
            try:  # the recipe's types and bounds (contracts.recipe.Phase)
                phase = PlacedPhase(**Phase.model_validate(fields).model_dump(), first_step=first)
            except ValidationError as error:
                raise ValueError(f"phase {number}: {first_error(error)}") from None
            try:  # here, before any data is read, not at the phase's first batch
                check_resolution(phase.resolution, size_multiple)
            except ValueError as error:
                raise ValueError(f"phase {number}: {error}") from None
            self.phases.append(phase)
            first += phase.steps
        self.total_steps = first - 1
        self._firsts = [phase.first_step for phase in self.phases]

    def phase_index(self, step: int) -> int:
        """The phase that trains `step` (1-based); past the end, the last phase."""
        return max(0, bisect.bisect_right(self._firsts, step) - 1)

    def phase(self, step: int) -> PlacedPhase:
        return self.phases[self.phase_index(step)]

    def learning_rate(self, step: int) -> float:
        """The learning rate of `step`: the phase's, ramped up over its warm-up steps, then maybe a cosine down."""
        phase = self.phase(step)
        done = step - phase.first_step + 1  # steps of this phase so far, this one included
        if done < 1:  # before the plan's first step: a job that has not resumed yet trains none of these
            return 0.0
        if done < phase.warmup_steps:
            return phase.learning_rate * done / phase.warmup_steps
        if phase.final_lr_fraction >= 1 or phase.steps <= phase.warmup_steps:
            return phase.learning_rate
        progress = (done - phase.warmup_steps) / (phase.steps - phase.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return phase.learning_rate * (phase.final_lr_fraction + (1 - phase.final_lr_fraction) * cosine)

    def check_resumed(self, step: int) -> int:
        """`step` (the steps done when the job starts) if the plan goes on from there; a plan starting later
        needs the checkpoint of the step before its first."""
        first = self.phases[0].first_step
        if step < first - 1:
            raise ValueError(f"the run plan starts at step {first} (--first-step) but the job resumes at step {step}: "
                             f"it needs the checkpoint of step {first - 1}, which the lineage's run-plan job before "
                             "this one writes")
        return step

    def describe(self) -> list[dict]:
        """The phases as the run record and its logs list them (their `stage` key is what recorded runs carry)."""
        return [
            {"stage": number, "first_step": s.first_step, "steps": s.steps, "resolution": s.resolution,
             "batch_size": s.batch_size, "learning_rate": s.learning_rate, "warmup_steps": s.warmup_steps,
             "final_lr_fraction": s.final_lr_fraction}
            for number, s in enumerate(self.phases)
        ]


def read_run_config(name: str) -> dict:
    """`configs/runs/<name>.json`, or the JSON file `name` names."""
    path = Path(name) if name.endswith(".json") else RUNS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in RUNS_DIR.glob("*.json"))
        raise ValueError(f"unknown run config {name!r}; presets: {', '.join(known)} (or a path to a .json file)")
    return run_config_of(json.loads(path.read_text()))


def run_config_of(config: dict) -> dict:
    """A run config with its aliases read as their names: `"stages"` is `"phases"` (both at once is refused)."""
    for alias, name in RUN_CONFIG_ALIASES.items():
        if alias in config:
            if name in config:
                raise ValueError(f"a run config sets {name!r} or its older name {alias!r}, not both")
            config = {**{k: v for k, v in config.items() if k != alias}, name: config[alias]}
    return config


def plan_from_args(run_config: str | None, steps: int | None, batch_size: int | None, resolution: int | None,
                   learning_rate: float | None, warmup_steps: int, default_resolution: int,
                   final_lr_fraction: float = 1.0, first_step: int = 1, size_multiple: int = 1) -> RunPlan:
    """The run's phases, from `first_step` on: the run config's, or one phase from the single-phase arguments
    (`steps` is then the run's last step, so the phase has `steps - first_step + 1`); every phase's resolution
    a multiple of the models' `size_multiple`."""
    if run_config:
        given = [name for name, value in (("steps", steps), ("batch-size", batch_size), ("resolution", resolution),
                                          ("learning-rate", learning_rate)) if value is not None]
        if given:
            raise ValueError(f"run-config {run_config!r} sets the phases; drop {', '.join(given)} (each phase has its own)")
        return RunPlan(read_run_config(run_config)["phases"], first_step, size_multiple)
    return RunPlan([{
        "resolution": resolution or default_resolution,
        "batch_size": batch_size or 4,
        "learning_rate": learning_rate or 1e-4,
        "steps": (1000 if steps is None else steps) - first_step + 1,
        "warmup_steps": warmup_steps,
        "final_lr_fraction": final_lr_fraction,
    }], first_step, size_multiple)
