"""bench/metric_definitions.py: a result line under a fixed name measured what the name's definition says."""

import json

import pytest

from bench import metric_definitions
from bench.metric_definitions import KNOWN_MISLABELED, RESULTS, mislabeled, problems

LATENT_SOURCE = "latent shards (trainer/jobs/encode.py) through the trainer's loader; text encoder online on stored ids"


def ratio(metric: str, source: str, name: str = "latent512+compile") -> dict:
    return {"metric": metric, "value": 2.32, "unit": "ratio",
            "config": {"resolution": 512, "batch": 64, "ours": name, "ours_source": source},
            "machine": {"gpu": "NVIDIA H200", "nproc": 16}}


def test_the_image_ratio_measured_on_latent_shards_is_mislabeled() -> None:
    assert problems(ratio("train.ratio_vs_diffusers_512", LATENT_SOURCE)) == [
        "measured on latent shards, defined on image shards"]
    assert problems(ratio("train.ratio_vs_diffusers_512_latent", LATENT_SOURCE)) == []
    assert problems(ratio("train.ratio_vs_diffusers_512", "image shards, VAE + text encoder online", "image512")) == []


def test_a_ratio_line_without_a_source_is_told_by_its_configuration_s_name() -> None:
    line = ratio("train.ratio_vs_diffusers_512", "", "image512")
    del line["config"]["ours_source"]
    assert problems(line) == []
    assert problems({**line, "metric": "train.ratio_vs_diffusers_512_latent"}) == [
        "measured on image shards, defined on latent shards"]


@pytest.mark.parametrize("change, problem", [
    ({"config": {"name": "resident512", "resolution": 512,
                 "source": "unet-only, latents resident (random latents on the GPU; NOT latent shards)"}},
     "measured on neither image nor latent shards, defined on latent shards"),
    ({"config": {"name": "latent256", "resolution": 256, "source": LATENT_SOURCE}}, "resolution 256, defined at 512"),
    ({"model_config": "small"}, "model_config 'small', defined for 'sd2'"),
    ({"machine": {"gpu": "cpu", "nproc": 2}}, "GPU 'cpu', defined on one H200"),
])
def test_a_throughput_line_must_match_its_name_s_shards_size_model_and_gpu(change: dict, problem: str) -> None:
    line = {"metric": "train.img_per_s_512_latent", "value": 150.0, "unit": "img/s", "model_config": "sd2",
            "config": {"name": "latent512+compile", "resolution": 512, "source": LATENT_SOURCE},
            "machine": {"gpu": "NVIDIA H200", "nproc": 16}}
    assert problems(line) == []
    assert problems({**line, **change}) == [problem]


def test_the_demo_s_grid_is_the_shipped_recipe_s_and_a_variant_s_line_is_mislabeled() -> None:
    line = {"metric": "demo.prompt_match_grid", "value": 0.9, "unit": "share",
            "config": {"variant": "shipped", "overrides": {}, "seeds": [0, 1]}}
    assert problems(line) == []
    assert problems({**line, "config": {}}) == []  # make demo's own line: no variant, the recipe as shipped
    assert problems({**line, "config": {"variant": "lr3e-3", "overrides": {"learning-rate": "0.003"}}}) == [
        "the recipe's variant 'lr3e-3', defined for the shipped recipe"]
    assert problems({**line, "metric": "demo.prompt_match_grid_variant", "config": {"variant": "lr3e-3"}}) == []


def test_a_name_without_a_definition_of_its_configuration_is_not_checked() -> None:
    assert problems({"metric": "train.config.resident512", "value": 90.0, "config": {"name": "resident512"}}) == []


def test_results_md_has_no_mislabeled_row_but_the_known_old_ones() -> None:
    assert set(mislabeled(RESULTS)) == set(KNOWN_MISLABELED)
    assert metric_definitions.main([str(RESULTS)]) == 0


def test_a_new_mislabeled_row_fails_the_check(tmp_path, capsys) -> None:
    results = tmp_path / "RESULTS.md"
    line = ratio("train.ratio_vs_diffusers_512", LATENT_SOURCE)
    results.write_text(f"# Results\n\n## A later lease (2026-12-05)\n\n```\n{json.dumps(line)}\n```\n")

    assert metric_definitions.main([str(results)]) == 1
    assert "2026-12-05 train.ratio_vs_diffusers_512 = 2.32: measured on latent shards" in capsys.readouterr().out


def test_the_correction_note_in_results_names_every_known_row() -> None:
    # sections are only ever appended: the note is the one titled "Correction", wherever later ones put it
    [last] = [section for section in RESULTS.read_text().split("\n## ") if section.startswith("Correction:")]
    for (date, metric, value), name in KNOWN_MISLABELED.items():
        assert all(part in last for part in (f"`{metric}`", str(value), f"`{name}`", date)), (metric, value)
