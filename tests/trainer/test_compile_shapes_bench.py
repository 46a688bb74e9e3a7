"""bench/compile_shapes.py: the bucket shapes it compiles, and one mode's line on the CPU (Dynamo's eager backend)."""

from types import SimpleNamespace

import pytest
import torch
import torch._inductor.config

from bench import compile_shapes


def test_the_shapes_are_the_square_then_buckets_of_distinct_areas_over_the_aspect_range():
    shapes = compile_shapes.spread_shapes(512, 16, 6)
    assert shapes[0] == (512, 512) and len(shapes) == 6
    assert len({width * height for width, height in shapes}) == 6  # a transpose would give the blocks no new shape
    assert all(width > height for width, height in shapes[1:])
    assert shapes[-1][0] / shapes[-1][1] > 1.8  # out to the widest bucket (2:1 at most)
    with pytest.raises(ValueError, match="fewer than --shapes 40"):
        compile_shapes.spread_shapes(512, 16, 40)


@pytest.mark.slow(seconds=30)
def test_a_mode_compiles_every_shape_once_and_reports_each():
    args = SimpleNamespace(preset="tiny-pixart", resolution=64, shapes=3, batch=1, steps=1, backend="eager", device="cpu")
    dynamo, inductor = torch._dynamo.config, torch._inductor.config
    saved = dynamo.recompile_limit, dynamo.accumulated_recompile_limit, inductor.fx_graph_cache  # the mode sets them
    torch._dynamo.reset()
    try:
        line = compile_shapes.measure_mode("static", args)
    finally:
        torch._dynamo.reset()
        dynamo.recompile_limit, dynamo.accumulated_recompile_limit, inductor.fx_graph_cache = saved
    assert [entry["shape"] for entry in line["per_shape"]] == [[64, 64], [72, 56], [80, 48]]
    assert line["graphs"] == 2 * 3  # a graph for each kind of block input, at each shape: none ran eager
    assert line["value"] == pytest.approx(sum(entry["first_step_s"] for entry in line["per_shape"]), abs=0.2)
    assert all(entry["img_per_s"] > 0 for entry in line["per_shape"]) and len(line["revisit_step_s"]) == 3
