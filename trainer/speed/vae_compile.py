"""The frozen VAE's encoder compiled for training on image shards, and made eager again before a save.

On by default wherever the UNet's step compiles (`--compile`, trainer/jobs/train.py) and the job
reads image shards; the encode job compiles it on a GPU (trainer/jobs/encode.py).
"""

import torch

from trainer.models.bundle import Models

def compile_vae_encoder(models: Models, channels_last: bool = False, backend: str = "inductor") -> None:
    """Compile the frozen VAE's encoder in place (`nn.Module.compile`: the same module and weights, so
    checkpoints and the saved pipeline do not change), optionally with channels-last weights.

    For training on image shards on a GPU, where the encoder runs on every step: eager, it took more
    GPU time than the UNet's forward and backward at 512 (bench/RESULTS.md). One graph per bucket
    shape, as the UNet's. Channels-last weights must be made contiguous again before a save
    (`vae_encoder_eager`).
    """
    if channels_last:
        models.vae.encoder.to(memory_format=torch.channels_last)
    models.vae.encoder.compile(dynamic=False, backend=backend)


def vae_encoder_eager(models: Models) -> None:
    """Undo compile_vae_encoder: the encoder eager again, its weights contiguous."""
    models.vae.encoder.to(memory_format=torch.contiguous_format)
    models.vae.encoder._compiled_call_impl = None  # what nn.Module.compile set; None is nn.Module's own default
