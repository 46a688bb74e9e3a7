"""How long a training job takes from process start to its first optimizer step, and what a compile-cache file saves.

    C="--shards /tmp/shards --latent-dir /tmp/lat --compile-cache /tmp/cc --steps 12 --warmup 3 --compile-warmup 3"
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 python bench/train_first_step.py $C --encode 512
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2 python bench/train_first_step.py $C --encode 512

The first configuration of `--configs` (default `latent512+default`, what a job with default
parameters runs) gives `train.first_step_s`, with every setup phase in the trainer's order
(bench/train_timing.py). With `--compile-cache DIR` and a compiled first configuration, its shape's
trainer.speed.compile_cache file is loaded before its first step and saved after: the first process
writes it (`train.first_step_s_compiled_cold`), the second, with its own empty Inductor and Triton
directories, starts from it (`_warm`). Any further configurations run as in bench/train_throughput.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `trainer`, as under pytest

from bench.train_harness import note, parse, parser, since_start, start  # noqa: E402
from bench.train_latents import prepare_latents  # noqa: E402
from bench.train_timing import measure  # noqa: E402


def main() -> None:
    arguments = parser(__doc__.splitlines()[0], "latent512+default")
    arguments.add_argument("--compile-cache", default=None,
                           help="trainer.speed.compile_cache's directory: the first configuration (compiled) loads its "
                                "shape's file before its first step and saves it after; gives "
                                "train.first_step_s_compiled_warm/cold")
    args = parse(arguments)
    session = start(args, work=bool(args.configs or args.encode))
    if session is None:
        return
    prepare_latents(session)
    measure(session, compile_cache=args.compile_cache)
    note(event="done", seconds=round(since_start(), 1))


if __name__ == "__main__":
    main()
