"""The latent shards the latent configurations read: encoded from the image shards first (`--encode`), by
the trainer's own encode (trainer/jobs/encode.py, rank 0 alone), and found by the models' identity.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from bench.train_figures import significant, vae_figure
from bench.train_harness import skip_clock

if TYPE_CHECKING:
    from bench.train_harness import Bench, Session


def latent_dir_of(bench: Bench, resolution: int) -> str:
    """Where the latent shards of these models at `resolution` are (trainer.data.latents.latent_dir; the identity
    hashed once a process)."""
    from trainer.data.latents import latent_dir, models_identity
    if resolution not in bench.latent_dirs:
        bench.identity = bench.identity or models_identity(bench.models)
        bench.latent_dirs[resolution] = str(latent_dir(bench.args.latent_dir, bench.identity, resolution))
    return bench.latent_dirs[resolution]


def prepare_latents(session: Session, then: Callable[[int, dict | None], None] | None = None) -> None:
    """`--encode`: the image shards encoded at each resolution, its line emitted, then `then(resolution, line)`.
    The encode job is its own job: every figure timed from process start leaves all of it out."""
    for resolution in [int(r) for r in session.args.encode.split(",") if r]:
        started = time.time()
        line = encode_line(session.bench, resolution, session.common)
        if line:
            session.emit(line)
        if then:
            then(resolution, line)
        skip_clock(time.time() - started)


def encode_line(bench: Bench, resolution: int, common: dict) -> dict | None:
    """Encode the image shards at `resolution` (rank 0; the other ranks wait and read them): the encode line, on rank 0."""
    from trainer.data.latents import models_identity
    from trainer.jobs.encode import encode_shards
    from trainer.runtime import distributed
    args, models, processes = bench.args, bench.models, bench.processes
    started = time.time()
    identity = bench.identity or models_identity(models)
    hashed = time.time() - started
    bench.identity = identity
    latent_dir_of(bench, resolution)
    summary = None
    if processes.rank == 0:  # ranks writing the same shards would overwrite each other's
        summary = encode_shards(args.shards, args.latent_dir, models, resolution, bench.device, args.encode_batch,
                                args.num_workers, True, identity)
    distributed.barrier()
    if summary is None:
        return None
    if not summary["samples_encoded"]:  # every latent shard was there already (an earlier call on this machine)
        print(json.dumps({"progress": True, "event": "encode_skipped", "resolution": resolution,
                          "note": "latent shards already present; no rate to report"}), flush=True)
        return None
    rate = summary["samples_encoded"] / max(summary["seconds"], 1e-9)
    line = {"metric": f"train.encode_img_per_s_{resolution}", "value": round(rate, 1), "unit": "img/s",
            "config": {"samples": summary["samples_encoded"], "shards": summary["shards_written"],
                       "seconds": summary["seconds"], "identity_hash_s": round(hashed, 1), "batch": args.encode_batch,
                       "num_workers": args.num_workers, "corrupt": len(summary["corrupt"]), "vae": "bf16, eager",
                       "note": "trainer.jobs.encode.encode_shards: decode + bucket crop (loader workers), VAE encoder, "
                               "tokenizer, safetensors + tar writing"}, **common}
    vae_tflop, basis = vae_figure(bench, resolution)
    if vae_tflop:
        line["vae_tflop_per_s"], line["vae_flops_basis"] = significant(rate * vae_tflop), basis
    return line
