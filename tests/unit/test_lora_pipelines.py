"""contracts.lora_pipelines against the installed diffusers: every pipeline class it lets a LoRA train on loads
LoRA weights, and PixArt, which cannot, is not one of them (the Lambdas have no diffusers to ask)."""

from __future__ import annotations

import diffusers
import pytest

from contracts import lora_pipelines


def test_the_table_names_the_diffusers_release_installed() -> None:
    # a new release may add or drop LoRA loaders: moving the pin means checking the table again
    assert diffusers.__version__.startswith(f"{lora_pipelines.DIFFUSERS}.")


@pytest.mark.parametrize("name", lora_pipelines.LORA_PIPELINES)
def test_every_pipeline_of_the_table_loads_lora_weights(name: str) -> None:
    assert hasattr(getattr(diffusers, name), "load_lora_weights")


def test_pixart_cannot_load_lora_weights_and_is_not_in_the_table() -> None:
    assert not hasattr(diffusers.PixArtSigmaPipeline, "load_lora_weights")
    assert "PixArtSigmaPipeline" not in lora_pipelines.LORA_PIPELINES
    assert not lora_pipelines.takes_lora("PixArtSigmaPipeline")
    assert lora_pipelines.takes_lora("StableDiffusionPipeline")


def test_a_job_trains_a_lora_only_with_train_lora() -> None:
    assert lora_pipelines.trains_lora({"train": "lora", "steps": "2"})
    assert not lora_pipelines.trains_lora({"train": "full"})
    assert not lora_pipelines.trains_lora({"steps": "2"})  # TrainOptions.train defaults to full
