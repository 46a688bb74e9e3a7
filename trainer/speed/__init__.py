"""Speed levers of the training step, each measured by bench/ (bench/RESULTS.md), and whether a job runs it by default.

- fast_defaults.py: not a lever but the table behind the `auto` ones: configs/defaults/fast.json, the
  fastest configuration measured per (preset, resolution). `--compile auto` and `--cuda-graphs auto`
  (trainer/jobs/train.py's defaults) read it; a CPU never compiles.
- torch.compile of the UNet's step (`--compile`, in trainer/jobs/train.py): on by default on a GPU
  wherever the table measured it faster at every phase's resolution (sd2 at 256 and 512, small at 256,
  sdxl at 1024); off on a CPU and for presets the table lacks (tiny).
- regional_compile.py: a transformer family's repeated blocks compiled in place (`--compile` for SD3,
  PixArt and Flux): on by default on a GPU where the table measured it (sd3-medium and pixart-sigma at
  256, 512 and 1024, flux1 at 512 and 1024), except under FSDP over several processes.
- vae_compile.py: the frozen VAE encoder compiled: on wherever the UNet's step compiles and the job reads
  image shards; the encode job compiles it on a GPU by default (its `--compile auto`).
- compile_cache.py: Inductor's output kept per shape and loaded at start: on whenever the step
  compiles (`--compile-cache`, default `<checkpoint-dir>/compile-cache`; `none` turns it off).
- cuda_graphs.py: the UNet's forward, loss and backward replayed from CUDA graphs (`--cuda-graphs`):
  by default (`auto`) only for one process on a GPU where the table measured it faster (today
  small at 256); `true` where it cannot run stops the job at start.
- fused_norm.py: GroupNorm+SiLU as one Triton kernel: off; no job uses it (bench/train_throughput.py's `+gnsilu`).
- master_weights.py: bf16 weights with fp32 masters: off; no job uses it (bench/train_throughput.py's `+bf16w`).

Levers that are flags of trainer/jobs/train.py alone: `--fused-adamw` (on by default, on a GPU
with DDP or one process), `--channels-last` (off: measured slower eager) and
`--gradient-checkpointing` (off: less memory, about 30% more time).
"""
