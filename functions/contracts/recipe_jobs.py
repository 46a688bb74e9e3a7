"""The options of a training job's helper jobs, the encode job (trainer/jobs/encode.py), the autoencoder job
(trainer/jobs/autoencoder.py) and the tokenizer job (trainer/jobs/tokenizer.py), and of the evaluation job
(trainer/jobs/evaluate.py), as contracts.recipe types the training job's.

A field marked `from_training_job` is one the job shares with the training job it serves: the start-training
function copies those, and only those, from the training job's hyperparameters into its own
(core/start_training/job_requests.py), since the latents and the VAE must match what the training job trains on.
The rest are the job's own (an encode job's batch size is images per VAE call, not the training job's).
tests/trainer/test_recipe.py holds each `from_training_job` field to the training option of the same name.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from contracts import model_presets
from pydantic import field_validator

from contracts.recipe import AutoFlag, Flag, Options, option

ENCODE_PATHS = ("train-dir", "manifest", "index-dir", "output-dir")  # flags the container or the SM_* environment set
AUTOENCODER_PATHS = ("train-dir", "index-dir", "validation-dir", "manifest", "model-dir", "output-data-dir",
                     "checkpoint-dir")
TOKENIZER_PATHS = ("train-dir", "index-dir", "manifest", "model-dir", "output-data-dir", "checkpoint-dir")
EVALUATE_PATHS = ("candidate-dir", "baseline-dir", "eval-dir", "clip-dir", "model-dir")
DEFAULT_EVAL_TIMESTEPS = "100,300,500,700,900"


class EncodeOptions(Options):
    """trainer.jobs.encode's options."""

    task: ClassVar[str] = "encode"
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

    task: ClassVar[str] = "autoencoder"
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


class TokenizerOptions(Options):
    """trainer.jobs.tokenizer's options."""

    task: ClassVar[str] = "tokenizer"
    preset: str = option(model_presets.DEFAULT, "the preset whose text encoders need them", from_training_job=True,
                         flag="model-config")
    vocab_size: int = option(0, "the vocabulary ceiling (0: each text encoder's, CLIP 49,408 and T5 32,000)")
    # accepted so every job of a lineage takes the same arguments (a tokenizer has no other use for them)
    pretrained: str | None = option(None, "the lineage's base (unused: this job runs because the base has no tokenizer)")
    seed: int | None = option(None, "the lineage's seed (unused: learning a tokenizer draws nothing)")
    resolution: int | None = option(None, "the lineage's resolution (unused)")

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, value: int) -> int:
        if value < 0:
            raise ValueError("the vocabulary ceiling is 0 (the encoder's own) or a positive number of ids")
        return value


class EvaluateOptions(Options):
    """trainer.jobs.evaluate's options: the evaluation job's hyperparameters (what the deploy gate scores with)."""

    task: ClassVar[str] = "evaluate"
    timesteps: str = option(DEFAULT_EVAL_TIMESTEPS, "comma-separated noise timesteps for a UNet's loss (a flow "
                            "model's is MLPerf's 8 equidistant ones)")
    seed: int = option(0, "seeds every noise draw and sampled image")
    max_samples: int = option(64, "the first N readable eval samples", also=("max_samples",))
    resolution: int | None = option(None, "square image side (default: the candidate's last training phase, else its "
                                    "built size)")
    steps: int = option(20, "DDIM steps for the CLIP images")
    guidance: float = option(5.0, "classifier-free guidance for the CLIP images")

    @field_validator("timesteps")
    @classmethod
    def _timesteps(cls, text: str) -> str:
        parts = text.split(",")
        if not all(part.strip().isdigit() for part in parts) or len({int(part) for part in parts}) != len(parts):
            raise ValueError("timesteps are distinct non-negative integers, comma-separated")
        return text

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if value < 0:
            raise ValueError("the seed is >= 0")
        return value

    @field_validator("max_samples", "steps")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("resolution")
    @classmethod
    def _resolution(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("a resolution is a positive number of pixels")
        return value
