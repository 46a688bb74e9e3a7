"""Regional compilation of a transformer family: each repeated block compiled in place, not the whole model.

diffusers' `ModelMixin.compile_repeated_blocks` compiles every module whose class its model names in
`_repeated_blocks`. Inductor then compiles one block of a type and reuses its code for every other block of
that type, so a model of dozens of identical blocks compiles in about the time of one of each: FLUX.1's 57
blocks did not finish compiling whole in the ~150 s left of a call, and compile regionally in 32-44 s
(bench/RESULTS.md, 2026-12-06). The blocks are
compiled in place (`nn.Module.compile`): the module tree, its parameter names and what a checkpoint saves
do not change. diffusers 0.42's SD3 and PixArt classes name no repeated blocks, so the family names them here.
"""

import torch

# Graphs Dynamo keeps a compiled function per input shape. The whole UNet: one. A block: one per kind of input it
# meets, and two were met per shape on SD3-medium and PixArt-Sigma (bench/compile_shapes.py, 2026-12-06): the first
# block reads fp32 hidden states, the others autocast's bf16 ones. Twice that is a margin for kinds not measured.
GRAPHS_A_SHAPE = {"whole": 1, "regional": 4}

REPEATED_BLOCKS = {
    "sd3": ("JointTransformerBlock",),
    "pixart": ("BasicTransformerBlock",),
    "flux": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
}


def compile_mode(requested: bool | str, measured_faster: bool, family_name: str | None, sharded: bool) -> str | None:
    """How a training job compiles: None (eager), "whole" (torch.compile of the model the step calls: the UNet
    family) or "regional" (a transformer family's blocks, as fast as the whole model's compile where both were
    measured and 4-8x quicker to compile: bench/RESULTS.md, 2026-12-06).

    `requested` is --compile (True, False or "auto"); `measured_faster` what --compile auto reads from the table
    (trainer/speed/fast_defaults.py). A transformer family sharded by FSDP over several processes stays eager
    under "auto": compiled blocks under fully_shard have not run on GPUs (one GPU is all this project has been
    lent). --compile true compiles them before fully_shard, which then puts its hooks inside each block's
    compiled call (torchtitan instead wraps the block, leaving them outside); a CPU run of two gloo ranks did
    train so, but no test holds it."""
    compiling = measured_faster if requested == "auto" else bool(requested)
    if not compiling:
        return None
    if family_name is None:
        return "whole"
    return None if sharded and requested == "auto" else "regional"


def allow_graphs(mode: str, shapes: int) -> int:
    """Raise Dynamo's limits on a compiled function's graphs (8 for the same guarded objects, 256 in all, by default)
    so that a job compiled in `mode` keeps a graph for each of its `shapes` bucket shapes; returns the first. Past a limit Dynamo runs the other
    shapes eager with only a warning: 4 shapes of regional graphs used SD3-medium's 8 and the fifth ran eager, 0.76x
    (bench/RESULTS.md)."""
    config = torch._dynamo.config
    wanted = GRAPHS_A_SHAPE[mode] * shapes
    config.recompile_limit = max(config.recompile_limit, wanted)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, wanted)
    return config.recompile_limit


def compile_regions(model: torch.nn.Module, family_name: str, backend: str = "inductor",
                    dynamic: bool | None = False) -> None:
    """Compile `model`'s repeated blocks in place: one graph per input shape (`dynamic` False, as the whole-model
    compile), or as torch.compile's `dynamic` otherwise."""
    if family_name not in REPEATED_BLOCKS:
        raise ValueError(f"no repeated blocks are named for family {family_name!r}; "
                         f"regional compilation knows {sorted(REPEATED_BLOCKS)}")
    model._repeated_blocks = list(REPEATED_BLOCKS[family_name])  # what compile_repeated_blocks reads
    model.compile_repeated_blocks(dynamic=dynamic, backend=backend)
