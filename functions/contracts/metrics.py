"""The metrics SageMaker parses from the trainer's JSON log lines (docs/trainer.md): the training
job's request carries these definitions, and trainer/runtime/health.py logs the fields they match."""

from __future__ import annotations

TRAINING_FIELDS = ("loss", "lr", "grad_norm", "img_per_s", "data_wait_share", "skipped_steps", "corrupt_samples")
AUTOENCODER_FIELDS = ("loss", "psnr_db")  # trainer/jobs/autoencoder.py: its loss, and the held-out PSNR at each


def definitions(namespace: str, fields: tuple[str, ...]) -> list[dict[str, str]]:
    """MetricDefinitions: `<namespace>:<field>` for each `"<field>": <number>` of a log line."""
    return [{"Name": f"{namespace}:{field}", "Regex": f'"{field}": ([-+0-9.eE]+)'} for field in fields]


METRIC_DEFINITIONS = definitions("train", TRAINING_FIELDS)
AUTOENCODER_METRIC_DEFINITIONS = definitions("autoencoder", AUTOENCODER_FIELDS)
