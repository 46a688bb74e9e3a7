"""trainer.jobs.train's arguments: each flag, its default (from the SageMaker environment: SM_CHANNEL_TRAIN,
SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, and SM_HPS's values when set) and the checks that fail a job before it starts.
docs/trainer.md's "Arguments" lists them.
"""

import argparse
import json
import os

from contracts import model_presets
from trainer.jobs.hyperparameters import auto_or_boolean, boolean

DEFAULT_VALIDATION_PROMPTS = ("a red dog on the beach|a photo of a city street at night|a bowl of fruit on a table"
                              "|a mountain lake at sunrise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Train a latent-diffusion UNet on Atelier shards.")
    where = parser.add_argument_group("where")
    where.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                       help="directory with the *.tar shards, at any depth (default $SM_CHANNEL_TRAIN)")
    where.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                       help="where the pipeline is saved (default $SM_MODEL_DIR)")
    where.add_argument("--output-data-dir", default=env.get("SM_OUTPUT_DATA_DIR"),
                       help="loss curve and validation grids (default $SM_OUTPUT_DATA_DIR, else <model-dir>/health)")
    where.add_argument("--checkpoint-dir", default=None,
                       help="checkpoints go here; none are written without it (SageMaker: /opt/ml/checkpoints)")
    where.add_argument("--resume", default="latest", help="'latest' (the newest complete checkpoint, if any), 'none', or a checkpoint directory")
    where.add_argument("--index-dir", default=env.get("SM_CHANNEL_INDEXES"),
                       help="the shards' sample tables (default $SM_CHANNEL_INDEXES, else <train-dir>/indexes)")
    where.add_argument("--manifest", default=env.get("SM_CHANNEL_MANIFEST"),
                       help="the job's manifest JSON (or the channel dir holding it): its `exclude` samples are never "
                            "read (default $SM_CHANNEL_MANIFEST)")
    model = parser.add_argument_group("model")
    model.add_argument("--model-config", default=model_presets.DEFAULT, help="a preset in trainer/configs/ (without .json)")
    model.add_argument("--pretrained", default=None,
                       help="a diffusers pipeline, or some of its subfolders (vae, text_encoder + tokenizer, scheduler, "
                            "unet): a directory, a channel name or a model.tar.gz; what it lacks comes from --model-config")
    model.add_argument("--vae", default=None,
                       help="an AutoencoderKL (the autoencoder job's model: a directory, channel or model.tar.gz); "
                            "replaces the base's")
    model.add_argument("--tokenizer", default=None,
                       help="the pipeline's tokenizer subfolders for text encoders the base does not bring (a tokenizer "
                            "job's model: a directory, channel or model.tar.gz); without it they are learned from the "
                            "training shards' captions at start (trainer/models/text_tokenizers.py)")
    model.add_argument("--init-unet", default=None, choices=["pretrained", "random"],
                       help="fine-tune the base's UNet, or train one from scratch on its frozen parts "
                            "(default: the base's UNet when it has one)")
    model.add_argument("--train", default="full", choices=["full", "lora"],
                       help="full: every weight of the denoiser trains; lora: a low-rank adapter on the --pretrained "
                            "base's attention projections alone, saved beside the base (trainer/models/lora.py)")
    model.add_argument("--lora-rank", type=int, default=4, help="the adapter's rank (--train lora)")
    model.add_argument("--lora-alpha", type=int, default=None,
                       help="the adapter's alpha: its update is scaled by alpha / rank (default: the rank)")
    model.add_argument("--prediction-type", default=None, choices=["epsilon", "v_prediction"],
                       help="the UNet's target (default: the scheduler's)")
    model.add_argument("--zero-terminal-snr", type=boolean, default=False,
                       help="rescale the noise schedule to reach pure noise at its last step (needs v_prediction)")
    model.add_argument("--noise-offset", type=float, default=0.0, help="offset noise strength (0: off; 0.05 is common)")
    model.add_argument("--snr-gamma", type=float, default=None, help="min-SNR loss weighting with this gamma (5 is common; default off)")
    model.add_argument("--ema-decay", type=float, default=0.9999, help="EMA of the UNet weights (0: no EMA)")
    model.add_argument("--final-weights", default="ema", choices=["ema", "trained"], help="what the saved pipeline holds")
    run = parser.add_argument_group("run (a single stage unless --run-config)")
    run.add_argument("--run-config", default=None, help="stages preset in trainer/configs/runs/, or a .json path")
    run.add_argument("--steps", type=int, default=None, help="the run's last step, counting resumed ones (default 1000)")
    run.add_argument("--first-step", type=int, default=1, help="the run's first step; warm-up and cosine count from it")
    run.add_argument("--batch-size", type=int, default=None, help="images per micro-batch per process (default 4)")
    run.add_argument("--resolution", type=int, default=None, help="bucket area as a square side (default: the model's)")
    run.add_argument("--learning-rate", type=float, default=None, help="AdamW's, after warm-up (default 1e-4)")
    run.add_argument("--lr-warmup-steps", type=int, default=0, help="linear warm-up of a single-stage run")
    run.add_argument("--lr-final-fraction", type=float, default=1.0,
                     help="below 1: a cosine from the warm-up's end down to this share of the rate (single stage)")
    run.add_argument("--gradient-accumulation", type=int, default=1, help="micro-batches per optimizer step")
    run.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (inf: measure only)")
    run.add_argument("--seed", type=int, default=0, help="model init, data order, noise")
    system = parser.add_argument_group("system")
    system.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="how several processes share the UNet")
    system.add_argument("--gradient-checkpointing", type=boolean, default=False, help="recompute activations: less memory, ~30%% more time")
    system.add_argument("--num-workers", type=int, default=2, help="DataLoader processes per training process")
    system.add_argument("--compile", type=auto_or_boolean, default="auto",
                        help="torch.compile the UNet step, and on image shards the VAE encoder: true, false, or auto "
                             "(on a GPU where configs/defaults/fast.json measured it faster for the preset and resolution). "
                             "Minutes of compiling per shape unless --compile-cache holds it")
    system.add_argument("--compile-cache", default=None,
                        help="directory of compiled-shape files, read at start and written after each stage's first "
                             "step (default <checkpoint-dir>/compile-cache; also read: $SM_CHANNEL_COMPILE_CACHE; "
                             "'none': off)")
    system.add_argument("--cuda-graphs", type=auto_or_boolean, default="auto",
                        help="replay the UNet's forward and backward from a CUDA graph per shape (trainer/speed/cuda_graphs.py; "
                             "one process on a GPU): true, false, or auto (where configs/defaults/fast.json measured it "
                             "faster for the preset and resolution)")
    system.add_argument("--fused-adamw", type=boolean, default=True, help="fused AdamW kernels on a GPU (DDP or one process)")
    system.add_argument("--channels-last", type=boolean, default=False, help="channels-last UNet weights (measured slower eager)")
    data = parser.add_argument_group("data")
    data.add_argument("--aspect-buckets", type=boolean, default=True, help="batch by aspect ratio (else centre squares)")
    data.add_argument("--random-crop", type=boolean, default=False, help="random crops inside the bucket (else centred)")
    data.add_argument("--caption-dropout", type=float, default=0.1,
                      help="share of captions replaced by '' so guidance has an unconditional model to contrast with")
    health = parser.add_argument_group("checkpoints and health")
    health.add_argument("--checkpoint-every", type=int, default=500, help="also at the last step")
    health.add_argument("--keep-checkpoints", type=int, default=2, help="the newest K step directories are kept")
    health.add_argument("--async-checkpoints", type=boolean, default=True,
                        help="write each checkpoint in a thread while training goes on (its state copied to the host "
                             "first; trainer/runtime/checkpoint_writer.py), else in place")
    health.add_argument("--log-every", type=int, default=10, help="also at the last step")
    health.add_argument("--tensorboard-dir", default=None,
                        help="TensorBoard event files (default $SM_OUTPUT_DIR/tensorboard, else <health dir>/tensorboard; 'none': off)")
    health.add_argument("--max-nonfinite-steps", type=int, default=10, help="non-finite steps in a row that end the job")
    health.add_argument("--watchdog-minutes", type=float, default=30,
                        help="no optimizer step for this long (before the first: twice as long) dumps every thread's "
                             "stack, writes the failure reason and ends the job (0: off)")
    health.add_argument("--preflight-timeout", type=float, default=120,
                        help="seconds the start-up all-reduce over all ranks may take (it connects them too)")
    health.add_argument("--preflight-min-free-fraction", type=float, default=0.8,
                        help="share of each GPU's memory that must be free at start")
    health.add_argument("--validation-prompts", default=DEFAULT_VALIDATION_PROMPTS, help="'|'-separated; '' for none")
    health.add_argument("--validation-seeds", default="0", help="comma-separated; one grid column each")
    health.add_argument("--validation-inference-steps", type=int, default=None,
                        help="DDIM steps per grid (default 20 on a GPU; 4 on a CPU, where the grid is a smoke check)")
    # Inside a SageMaker training-toolkit image the hyperparameters arrive as SM_HPS, all strings;
    # argparse converts string defaults with each argument's type.
    hyperparameters = json.loads(env.get("SM_HPS", "{}"))
    parser.set_defaults(**{
        name.replace("-", "_"): str(value)
        for name, value in hyperparameters.items()
        if not name.startswith("sagemaker_")  # the SageMaker SDK's own settings, not ours
    })
    args = parser.parse_args(argv)
    if args.seed < 0 or args.gradient_accumulation < 1 or args.keep_checkpoints < 1:
        parser.error("--seed must be >= 0, --gradient-accumulation and --keep-checkpoints >= 1")
    if args.watchdog_minutes < 0 or args.preflight_timeout <= 0 or not 0 <= args.preflight_min_free_fraction <= 1:
        parser.error("--watchdog-minutes must be >= 0, --preflight-timeout > 0, --preflight-min-free-fraction in 0..1")
    if args.train == "lora" and not args.pretrained:
        parser.error("--train lora needs --pretrained: a LoRA adapts a pretrained base (a whole diffusers pipeline), "
                     "with which it is served")
    if args.lora_rank < 1 or args.lora_alpha is not None and args.lora_alpha < 1:
        parser.error("--lora-rank and --lora-alpha must be >= 1")
    return args
