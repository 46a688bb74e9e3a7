"""trainer/report/write.py: one self-contained page per training job; its tables, curves, grids and decisions."""

import io
import json
import re
import tarfile

from PIL import Image

from contracts.s3_layout import REPORT_FILE as REPORT
from trainer.report import render as report_html
from trainer.report.write import build, write_report
from tests.trainer.report_helpers import (  # noqa: F401  (run_dir, rich_run: fixtures)
    AUTOENCODER,
    HISTORY,
    cells_of,
    first_rows,
    rich_run,
    run_dir,
)


def test_table_cells_read_as_text_rounded_with_no_json_and_no_python_none(rich_run) -> None:
    page = build(*rich_run, job="atelier-0123")
    cells = cells_of(page).cells

    assert "None" not in re.sub(r"<script.*?</script>|data:image/png;base64,[^\"]*", "", page, flags=re.S)
    assert not [cell for cell in cells if cell[:1] in "{[" or '":' in cell or "True" in cell or "False" in cell]
    row = first_rows(cells)
    assert (row["final loss"], row["mean throughput (img/s)"], row["mean data-wait share"]) == ("0.2", "103.0", "3.0%")
    assert (row["steps"], row["shards seen"], row["stages"]) == ("5", "2", "\u2014")
    assert "eval set: ab12\nval loss: 0.3\nclip score: \u2014" in cells  # a nested dict as k: v lines; a float kept
    assert "0.30000000000000004" not in page  # as text (core.deploy.gate.Scores.to_item) rounded like the others
    assert "max loss: 1\nmax loss ratio: 1.1\nmin clip delta: -0.5" in cells
    assert "held out" in cells and "yes" in cells and "1e-06" in cells  # booleans, small figures
    assert "#7 abababababab: jobs atelier-0123; shards 1, left out 1" in cells
    assert "partner-a / CC-BY-4.0: 1, partner-b / CC-BY-4.0: 1" in cells


def test_a_figure_of_many_sorts_reads_rounded() -> None:
    table = report_html._table({"final_loss": 0.123456789, "img_per_s": 812.3456, "data_wait_share": 0.01234,
                                    "psnr_db": 31.26, "big": 123456.7, "none": None, "flag": False, "empty": [],
                                    "names": ["a", "b"], "nan": float("nan"), "stages": [{"stage": 0, "learning_rate": 1e-4}]})
    cells = cells_of(table).cells

    assert cells[:-5] == ["final loss", "0.1235", "img per s", "812.3", "data wait share", "1.2%", "PSNR", "31.3 dB",
                          "big", "123,457", "none", "\u2014", "flag", "no", "empty", "\u2014", "names", "a, b",
                          "nan", "not finite", "stages"]
    assert cells[-5:-1] == ["stage", "learning rate", "0", "0.0001"]  # a list of documents: a small table of its own


def test_each_validation_grid_is_captioned_with_its_step(run_dir) -> None:
    page = build(*run_dir)

    assert re.findall(r"<figcaption>(.*?)</figcaption>", page) == ["step 2", "step 5"]


def test_an_autoencoder_job_s_report_shows_its_figures_and_its_reconstructions_beside_the_originals(tmp_path) -> None:
    # GIVEN an autoencoder job's dirs: autoencoder.json and reconstructions.png, no atelier-training.json
    model_dir, health_dir = tmp_path / "model", tmp_path / "data"
    model_dir.mkdir()
    health_dir.mkdir()
    (model_dir / "autoencoder.json").write_text(json.dumps(AUTOENCODER))
    Image.new("RGB", (128, 64), "green").save(health_dir / "reconstructions.png")

    # WHEN the job writes its report
    write_report(model_dir, health_dir, job="atelier-vae-1")

    # THEN the page has the Autoencoder section, and not the empty sections of a diffusion run
    page = (health_dir / REPORT).read_text()
    row = first_rows(cells_of(page).cells)
    assert "<h2>Autoencoder</h2>" in page and "<h2>Validation grids</h2>" not in page
    assert (row["PSNR"], row["PSNR baseline"], row["held out samples"], row["steps"], row["KL weight"]) == \
        ("27.8 dB", "21.0 dB", "8", "40", "1e-06")
    assert "<figcaption>originals (top) / reconstructions (bottom)</figcaption>" in page
    assert page.count("<polyline") == 2  # its loss and PSNR over the steps
    assert report_html.png_data_uri((health_dir / "reconstructions.png").read_bytes()) in page


def test_an_autoencoder_job_s_page_renders_again_from_its_output_data_alone(tmp_path) -> None:
    # GIVEN an autoencoder job's report, and its output data as SageMaker uploads it
    model_dir, health_dir = tmp_path / "model", tmp_path / "data"
    model_dir.mkdir()
    health_dir.mkdir()
    (model_dir / "autoencoder.json").write_text(json.dumps(AUTOENCODER))
    Image.new("RGB", (128, 64), "green").save(health_dir / "reconstructions.png")
    write_report(model_dir, health_dir, job="atelier-vae-1")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(health_dir, arcname=".")
    archive.seek(0)

    # WHEN `atelier report --job` renders it from output.tar.gz
    run, pictures = report_html.read_output(archive)

    # THEN it is the job's own page, reconstructions and all
    assert [label for label, _ in pictures] == ["reconstructions"]
    assert report_html.page("atelier-vae-1", run, pictures, None, None) == (health_dir / REPORT).read_text()


def ticks(svg: str, anchor: str) -> list[float]:
    """The numeric labels an SVG writes with text-anchor `anchor` (middle: the x axis; end: the y axis)."""
    labels = re.findall(rf'<text [^>]*text-anchor="{anchor}"[^>]*>([^<]*)</text>', svg)
    return [float(label.rstrip("%")) for label in labels if re.fullmatch(r"[-+0-9.e]+%?", label)]


def is_round(value: float) -> bool:
    """One significant digit: 1 to 9 x 10^k."""
    return value == 0 or f"{abs(value):e}".split("e")[0].rstrip("0").rstrip(".") in [str(d) for d in range(1, 10)]


def test_curves_carry_round_ticks_on_both_axes_and_axis_titles() -> None:
    points = [(s, 0.9 * 0.97 ** s) for s in range(10, 1001, 10)]
    svg = report_html.svg_curve(points, "training loss (log scale)", log_y=True, y_title="loss")

    assert ticks(svg, "middle") == [0, 200, 400, 600, 800, 1000]  # steps
    assert ticks(svg, "end") == [1e-14, 1e-11, 1e-08, 1e-05, 0.01, 10]  # decades over 14 of them, from below to above
    assert '>step</text>' in svg and '>loss</text>' in svg  # axis titles
    assert svg.count("<line") == 6 + 2 * 6  # a mark per tick, and a gridline per loss tick


def test_a_narrow_loss_range_gets_round_ticks_between_decades() -> None:
    svg = report_html.svg_curve([(1, 0.31), (2, 0.22), (3, 0.18)], "loss", log_y=True)

    assert ticks(svg, "end") == [0.1, 0.2, 0.5] and ticks(svg, "middle") == [1, 2, 3]
    assert all(is_round(t) for t in ticks(svg, "end") + ticks(svg, "middle"))


def test_a_share_curve_has_percent_ticks() -> None:
    svg = report_html.svg_curve([(1, 0.01), (2, 0.05)], "data-wait share", percent=True, y_title="share")

    assert [t for t in cells_of(svg).svg_texts if t.endswith("%")] == ["1%", "2%", "3%", "4%", "5%"]


def test_the_page_holds_three_curves_every_grid_and_no_external_reference(run_dir) -> None:
    page = build(*run_dir, job="atelier-0123")

    assert page.count("<svg") == 3 and page.count("<polyline") == 3
    assert re.findall(r'alt="validation grid (step-\d+)"', page) == ["step-00000002", "step-00000005"]
    assert page.count('src="data:image/png;base64,') == 2
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing to fetch: it opens anywhere


def test_without_evaluation_or_lineage_the_page_says_so(run_dir) -> None:
    page = build(*run_dir)

    assert "not evaluated" in page and "no lineage.json" in page


def test_the_gate_decision_and_the_lineage_are_shown(run_dir) -> None:
    model_dir, _ = run_dir
    (model_dir / "evaluation.json").write_text(json.dumps({"gate": {"passed": False, "reason": "clip score 0.1 < 0.2"}}))
    (model_dir / "lineage.json").write_text(json.dumps({"lineage": "main", "partners": ["partner-a"]}))
    page = build(*run_dir)

    assert '<span class="fail">fail</span>' in page and "clip score 0.1 &lt; 0.2" in page
    assert "partner-a" in page and "not evaluated" not in page


def test_the_report_is_written_beside_the_model_and_in_the_output_data(run_dir) -> None:
    written = write_report(*run_dir, history=HISTORY, job="atelier-0123")

    assert written == [run_dir[0] / REPORT, run_dir[1] / REPORT]
    assert written[0].read_text() == written[1].read_text()


def test_the_page_carries_the_run_s_figures_so_the_output_data_alone_renders_it_again(run_dir) -> None:
    # GIVEN the trainer's report written at the end of the run
    write_report(*run_dir, history=HISTORY, job="atelier-0123")
    written = (run_dir[1] / REPORT).read_text()

    # WHEN the page is rendered again from the output data alone (as `atelier report --job` does)
    run = report_html.run_from_page(written)
    grids = [(p.stem, p.read_bytes()) for p in sorted((run_dir[1] / "validation").glob("*.png"))]

    # THEN it is the trainer's page: one renderer
    assert (run["steps"], run["shards_seen"], run["history"]) == (5, 2, HISTORY)
    assert report_html.page("atelier-0123", run, grids, None, None) == written
