"""The blocks FSDP shards one by one: every block of the denoiser that holds weights, once, for each family."""

import pytest

from trainer.models.loading import load_models
from trainer.runtime.distributed import shard_units


@pytest.mark.parametrize("preset, blocks", [("tiny", None), ("tiny-sd3", 2), ("tiny-flux", 2), ("tiny-pixart", 2)])
def test_every_block_of_the_denoiser_is_a_unit_once(preset: str, blocks: int | None) -> None:
    denoiser = load_models(preset, None, seed=0).denoiser
    units = shard_units(denoiser)
    assert len({id(unit) for unit in units}) == len(units)
    if blocks is not None:  # a transformer: its blocks (Flux: one double- and one single-stream)
        assert len(units) == blocks
    in_units = {id(p) for unit in units for p in unit.parameters()}
    # what stays outside the units (embeddings, norms, projections in and out) is small beside them
    outside = sum(p.numel() for p in denoiser.parameters() if id(p) not in in_units)
    assert outside < sum(p.numel() for p in denoiser.parameters()) / 2
    if preset == "tiny-flux":
        assert units[-1] is denoiser.single_transformer_blocks[-1]
