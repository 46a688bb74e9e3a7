"""The trainer's model presets (trainer/configs/<name>.json) and each one's size multiple: a stage's
resolution, and both sides of every aspect bucket, must be multiples of it. It is the VAE's downsampling
times the denoiser's: the UNet's (2 per down block after the first) or a transformer's patch size
(`Models.size_multiple` in trainer/models/bundle.py).

StartTrainingFunction checks every run-plan stage against this table when it starts, before any job is
paid for (core/settings.py); the trainer checks the same rule where it reads its plan, with the size
multiple of the models it loaded (trainer/data/phases.py). tests/trainer/test_model_presets.py computes
the multiple from every preset and fails when this table and the presets disagree.
"""

DEFAULT = "tiny"  # the trainer's --model-config when a job names none
SIZE_MULTIPLES: dict[str, int] = {
    "tiny": 8, "demo": 8, "tiny-sdxl": 8, "tiny-sd3": 8, "tiny-pixart": 8, "demo-pixart": 8,
    "small": 64, "small-pixart": 16, "sd2": 64, "sdxl": 32, "sd3-medium": 16, "pixart-sigma": 16,
}


def resolution_refusal(hyperparameters: dict[str, str]) -> str | None:
    """Why a job with these (SageMaker, string) hyperparameters cannot train at its resolution; None if it can.
    Without `resolution` the trainer takes the preset's own size, a multiple already."""
    preset = hyperparameters.get("model-config", DEFAULT)
    if preset not in SIZE_MULTIPLES:
        return f"model-config {preset!r} is not a preset: {', '.join(sorted(SIZE_MULTIPLES))}"
    resolution, multiple = hyperparameters.get("resolution"), SIZE_MULTIPLES[preset]
    if resolution is not None and (not resolution.isdigit() or int(resolution) % multiple):
        return (f"resolution {resolution!r} must be a whole number of pixels, a multiple of {multiple} (model-config "
                f"{preset!r}: its VAE's downsampling times its denoiser's)")
    return None
