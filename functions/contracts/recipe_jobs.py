"""The options of a training job's helper jobs, the encode job (trainer/jobs/encode.py) and the autoencoder
job (trainer/jobs/autoencoder.py), as contracts.recipe types the training job's.

A field marked `from_training_job` is one the job shares with the training job it serves: the start-training
function copies those, and only those, from the training job's hyperparameters into its own
(core/start_training/job_requests.py), since the latents and the VAE must match what the training job trains on.
The rest are the job's own (an encode job's batch size is images per VAE call, not the training job's).
tests/trainer/test_recipe.py holds each `from_training_job` field to the training option of the same name.
"""

from __future__ import annotations

from typing import Literal

from contracts import model_presets
from contracts.recipe import AutoFlag, Flag, Options, option

ENCODE_PATHS = ("train-dir", "manifest", "index-dir", "output-dir")  # flags the container or the SM_* environment set
AUTOENCODER_PATHS = ("train-dir", "index-dir", "validation-dir", "manifest", "model-dir", "output-data-dir",
                     "checkpoint-dir")


class EncodeOptions(Options):
    """trainer.jobs.encode's options."""

    preset: str = option(model_presets.DEFAULT, "a preset in trainer/configs/, as the training job's",
                         from_training_job=True, flag="model-config")
    pretrained: str | None = option(None, "a local diffusers pipeline directory or channel, as the training job's",
                                    from_training_job=True)
    vae: str | None = option(None, "an AutoencoderKL directory, channel or model.tar.gz, as the training job's",
                             from_training_job=True)
    tokenizer: str | None = option(None, "the tokenizer folders, as the training job's (without: learned from the "
                                   "shards' captions, as the training job on the same image shards learns them)")
    seed: int = option(0, "random init of a preset (the training job's seed)", from_training_job=True)
    resolution: int | None = option(None, "bucket area as a square side (default: the model's)", from_training_job=True)
    aspect_buckets: Flag = option(True, "as the training job's", from_training_job=True)
    batch_size: int = option(16, "images per VAE call")
    num_workers: int = option(4, "processes decoding images")
    compile: AutoFlag = option("auto", "torch.compile the VAE encoder, every call padded to --batch-size so each "
                               "bucket shape compiles once: true, false, or auto (on a GPU)")


class AutoencoderOptions(Options):
    """trainer.jobs.autoencoder's options; TRAINING_AUTOENCODER_HYPERPARAMETERS set those not from the training job."""

    resume: str = option("latest", "'latest' (if any), 'none', or a checkpoint directory")
    preset: str = option(model_presets.DEFAULT, "the preset whose `vae` architecture is trained", from_training_job=True,
                         flag="model-config")
    pretrained: str | None = option(None, "the lineage's base, accepted so every job of a lineage takes the same "
                                    "arguments (unused: this job runs because the base has no VAE)")
    seed: int = option(0, "weights and data order", from_training_job=True)
    resolution: int | None = option(None, "bucket area as a square side (default: the VAE's sample size)",
                                    from_training_job=True)
    aspect_buckets: Flag = option(True, "batch by aspect ratio (else centre squares)")
    random_crop: Flag = option(True, "random crops inside the bucket")
    steps: int = option(2000, "optimizer steps")
    batch_size: int = option(16, "images per step")
    learning_rate: float = option(1e-4, "AdamW's, after warm-up")
    lr_warmup_steps: int = option(0, "linear warm-up")
    kl_weight: float = option(1e-6, "weight of the KL term (SD's VAE: 1e-6)")
    reconstruction_loss: Literal["l1", "mse"] = option("l1", "l1 (SD's VAE: sharper edges) or mse (what PSNR scores)")
    initial_logvar: float = option(-6.0, "the posterior's log-variance at step 0")
    max_grad_norm: float = option(1.0, "gradient clipping")
    max_eval_samples: int = option(64, "held-out images the PSNR is measured on")
    scaling_batches: int = option(8, "training batches the latents' std is measured on")
    num_workers: int = option(2, "DataLoader processes")
    log_every: int = option(50, "also at the last step; each line measures PSNR")
    checkpoint_every: int = option(500, "also at the last step")
    keep_checkpoints: int = option(2, "the newest K step directories are kept")
