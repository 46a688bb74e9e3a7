"""The trainer's model presets (trainer/configs/<name>.json) and each one's size multiple: a stage's
resolution, and both sides of every aspect bucket, must be multiples of it. It is the VAE's downsampling
times the denoiser's: the UNet's (2 per down block after the first) or a transformer's patch size (Flux's
2x2 packing; `Models.size_multiple` in trainer/models/bundle.py).

StartTrainingFunction checks every run-plan stage against this table when it starts, before any job is
paid for (core/settings.py); the trainer checks the same rule where it reads its plan, with the size
multiple of the models it loaded (trainer/data/phases.py). tests/trainer/test_model_presets.py computes
the multiple from every preset and fails when this table and the presets disagree.

The same goes for each preset's family (`unet`, or a transformer trained with flow matching) and, for SD3's
transformer, how many pixels a side its position table covers (`pos_embed_max_size` x patch x the VAE's
downsampling): a run without a base trains the preset's family, so the options it cannot take and the widest
bucket it can draw are known before any job starts (contracts.recipe.TrainOptions checks them).
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from contracts.bucket_sizes import widest_side

DEFAULT = "tiny"  # the trainer's --model-config when a job names none
SIZE_MULTIPLES: dict[str, int] = {
    "tiny": 8, "demo": 8, "tiny-sdxl": 8, "tiny-sd3": 8, "tiny-flux": 8, "tiny-pixart": 8, "demo-pixart": 8,
    "small": 64, "small-pixart": 16, "sd2": 64, "sdxl": 32, "sd3-medium": 16, "flux1": 16, "pixart-sigma": 16,
}


# the VAE's downsampling alone: what an autoencoder job's resolution must be a multiple of (it trains the VAE only)
VAE_DOWNSAMPLING: dict[str, int] = {
    "tiny": 4, "demo": 4, "tiny-sdxl": 4, "tiny-sd3": 4, "tiny-flux": 4, "tiny-pixart": 4, "demo-pixart": 4,
    "small": 8, "small-pixart": 8, "sd2": 8, "sdxl": 8, "sd3-medium": 8, "flux1": 8, "pixart-sigma": 8,
}


FAMILIES: dict[str, str] = {
    "tiny": "unet", "demo": "unet", "tiny-sdxl": "unet", "small": "unet", "sd2": "unet", "sdxl": "unet",
    "tiny-sd3": "sd3", "sd3-medium": "sd3", "tiny-flux": "flux", "flux1": "flux", "tiny-pixart": "pixart", "demo-pixart": "pixart", "small-pixart": "pixart",
    "pixart-sigma": "pixart",
}
POSITION_COVER: dict[str, int] = {"tiny-sd3": 256, "sd3-medium": 3072}  # SD3's position table, in pixels a side
# what a UNet preset's noise schedule predicts unless --prediction-type changes it
PREDICTION_TYPES: dict[str, str] = {name: "epsilon" for name, family in FAMILIES.items() if family == "unet"}


def schedule_refusal(preset: str, prediction_type: str | None, zero_terminal_snr: bool) -> str | None:
    """Why a UNet preset's schedule cannot be rescaled to zero terminal SNR: it predicts epsilon there."""
    if zero_terminal_snr and (prediction_type or PREDICTION_TYPES.get(preset, "v_prediction")) != "v_prediction":
        return "--zero-terminal-snr needs --prediction-type v_prediction (epsilon is undefined at SNR 0)"
    return None


def flow_refusal(family: str, prediction_type: str | None, zero_terminal_snr: bool, snr_gamma: float | None,
                 noise_offset: float) -> str | None:
    """Why a flow-matching family's run cannot take the UNet family's noise-schedule options; None if it sets none."""
    given = [flag for flag, value in (("--prediction-type", prediction_type), ("--zero-terminal-snr", zero_terminal_snr),
                                      ("--snr-gamma", snr_gamma), ("--noise-offset", noise_offset)) if value]
    if family == "unet" or not given:
        return None
    return (f"{', '.join(given)}: options of the UNet family's noise schedule; a {family} model trains with flow "
            "matching (its preset's `flow` block sets the timestep sampling)")


def position_refusal(preset: str, resolution: int | None, aspect_buckets: bool) -> str | None:
    """Why an SD3 preset cannot train at `resolution`: its widest aspect bucket passes the position table."""
    cover = POSITION_COVER.get(preset)
    if cover is None or resolution is None or resolution % SIZE_MULTIPLES[preset]:
        return None
    side = widest_side([resolution], SIZE_MULTIPLES[preset], aspect_buckets)
    if side <= cover:
        return None
    return (f"the widest image side at resolution {resolution} is {side} px (its aspect buckets), but {preset}'s "
            f"position table covers {cover} px: train with aspect-buckets false, at a lower resolution, or with a "
            "larger pos_embed_max_size")


def resolution_refusal(hyperparameters: dict[str, str], multiples: dict[str, int] = SIZE_MULTIPLES,
                       what: str = "its VAE's downsampling times its denoiser's") -> str | None:
    """Why a job with these (SageMaker, string) hyperparameters cannot train at its resolution; None if it can.
    Without `resolution` the trainer takes the preset's own size, a multiple already. `multiples`: the training
    job's (SIZE_MULTIPLES), or VAE_DOWNSAMPLING for an autoencoder job."""
    preset = hyperparameters.get("model-config", DEFAULT)
    if preset not in multiples:
        return f"model-config {preset!r} is not a preset: {', '.join(sorted(multiples))}"
    resolution, multiple = hyperparameters.get("resolution"), multiples[preset]
    if resolution is None:
        return None
    try:  # as the trainer's options parse it (contracts.recipe.TrainOptions): " 256" is 256, "²" is no number
        pixels = _PIXELS.validate_python(resolution)
    except ValidationError:
        pixels = 0
    if pixels <= 0 or pixels % multiple:
        return (f"resolution {resolution!r} must be a whole number of pixels, a multiple of {multiple} (model-config "
                f"{preset!r}: {what})")
    return None


_PIXELS = TypeAdapter(int)
