"""What a run samples from its weights: the plain UNet that holds them (for the validation grid at a
checkpoint and for the saved pipeline), the saved model, and at each checkpoint the loss curve and the
validation grid.
"""

from pathlib import Path

import torch

from trainer.data.phases import RunPlan
from trainer.models import lora
from trainer.models.bundle import Models
from trainer.models.families import note_training, saved_record
from trainer.models.pipelines import build_pipeline
from trainer.objectives.numerics import autocast
from trainer.runtime import distributed
from trainer.runtime.ema import EMA
from trainer.runtime.health import draw_loss_curve, validation_grid
from trainer.runtime.tensorboard_log import Board


def sampling_unet(models: Models, weights: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """A plain denoiser holding the given full weights (of a LoRA run: the base's with the adapter's), for sampling
    and saving (whatever wraps the trained one)."""
    if lora.adapter_config(models.denoiser) is not None:
        return lora.sampling_denoiser(models, weights, device)
    with torch.device("meta"):
        unet = type(models.denoiser).from_config(models.denoiser.config)
    unet.load_state_dict(weights, assign=True, strict=False)
    for name, buffer in models.denoiser.named_buffers():  # fixed tables (a transformer's positional embedding)
        path, _, leaf = name.rpartition(".")
        owner = unet.get_submodule(path)
        owner.register_buffer(leaf, buffer.detach().clone(), persistent=leaf not in owner._non_persistent_buffers_set)
    missing = [name for name, tensor in unet.state_dict().items() if tensor.is_meta]
    if missing:
        raise ValueError(f"no weights for {missing[:5]}")
    return unet.to(device).eval()


def weights_to_sample(unet, ema: EMA | None, use_ema: bool) -> dict[str, torch.Tensor]:
    """The EMA weights or the trained ones (of a LoRA run: the adapter's), whole (a collective under FSDP)."""
    return ema.full_weights() if ema is not None and use_ema else distributed.full_model_state(unet)


def save_model(models: Models, weights: dict[str, torch.Tensor], resolution: int, model_dir: Path,
               pretrained: str | None) -> dict | None:
    """The run's model in `model_dir`, in fp32: the family's pipeline holding `weights`, its default image size the
    last phase's `resolution`; or of a LoRA run the base's pipeline and the adapter (trainer/models/lora.py), whose
    record (atelier-lora.json) is returned."""
    models.frozen_to(torch.device("cpu"))  # saved in fp32 whatever the training device ran them in
    if lora.adapter_config(models.denoiser) is not None:
        return lora.save_adapter(models, weights, model_dir, pretrained)
    models.load_text_encoders()  # a family trained on stored embeddings: its text encoders, on the CPU, for the pipeline
    final_unet = sampling_unet(models, weights, torch.device("cpu"))
    final_unet.register_to_config(**default_size(final_unet.config, resolution // models.vae_scale_factor))
    build_pipeline(models, final_unet, resolution).save_pretrained(model_dir)
    return None


def default_size(config, sample_size: int) -> dict:
    """The config change that makes `sample_size` (latent side) the saved denoiser's default size. A PixArt
    transformer recomputes its positional embedding from its config when loaded, at positions scaled by
    sample_size / (patch * interpolation_scale): the scale moves with the size so the loaded model reads the
    positions it trained with. (SD3's table is saved with the weights; a UNet has none.)"""
    if "interpolation_scale" not in config:
        return {"sample_size": sample_size}
    scale = config.interpolation_scale or max(config.sample_size // 64, 1)  # the class's own default when unset
    return {"sample_size": sample_size, "interpolation_scale": scale * sample_size / config.sample_size}


def check_health(args, processes, models: Models, unet, ema: EMA | None, plan: RunPlan, step: int,
                 loss_history: list, health_dir: Path, board: Board) -> None:
    """At a checkpoint: redraw the loss curve and sample the validation grid (rank 0 writes). A family trained on
    stored embeddings samples from the prompts' embeddings, which its text encoders compute once on the CPU. It is
    guided as the saved model will be: by what the run's record will say (families.learned_unconditional)."""
    prompts = [prompt for prompt in args.validation_prompts.split("|") if prompt.strip()]
    weights = weights_to_sample(unet, ema, use_ema=True) if prompts else None
    if processes.rank == 0:
        draw_loss_curve(loss_history, health_dir / "loss.png")
        if prompts:
            denoiser = sampling_unet(models, weights, processes.device)
            # the fields of atelier-training.json the rule reads, as train.py writes them at the end
            note_training(denoiser, {"args": vars(args), "components": models.sources}, saved_record(models.base))
            pipeline = build_pipeline(models, denoiser, plan.phase(step).resolution)
            seeds = [int(seed) for seed in args.validation_seeds.split(",")]
            steps = args.validation_inference_steps or (20 if processes.device.type == "cuda" else 4)
            stored = models.family is not None and not models.text_encoders
            embeddings = models.stored_prompt_embeddings(prompts) if stored else None
            with autocast(processes.device):
                grid = validation_grid(pipeline, prompts, seeds, plan.phase(step).resolution, steps, embeddings)
            (health_dir / "validation").mkdir(parents=True, exist_ok=True)
            grid.save(health_dir / "validation" / f"step-{step:08d}.png")
            board.validation(step, grid)
    distributed.barrier()
