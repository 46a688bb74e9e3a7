"""trainer/report/write.py: one self-contained page per training job, checked in a real headless browser."""

import ast
import html
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from contracts.messages import LeftOut
from contracts.s3_layout import REPORT_FILE as REPORT
from core.provenance import JobSource, Lineage, ManifestSource, SampleSource, ShardSource
from tests.support import REPO
from trainer.report import render as report_html
from trainer.report.write import build, write_report
from trainer.runtime.health import label_grid

# Debian's build of Chrome's headless shell: `apt-get install chromium-headless-shell` (docs/runbook.md).
BROWSERS = ("chromium-headless-shell", "chrome-headless-shell", "chromium", "google-chrome")
HISTORY = [{"step": s, "loss": 1.0 / s, "img_per_s": 100.0 + s, "data_wait_share": 0.01 * s} for s in range(1, 6)]
# Appended to a copy of the page: once it has loaded, record what the browser made of it.
PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => i.complete && i.naturalWidth > 0);
  const curves = [...document.querySelectorAll("svg polyline")].map(p => p.getBBox().width > 0);
  document.body.dataset.probe = JSON.stringify({images, curves});
});</script>"""
# The same, with what a reader sees: the page's text, its height, the widest cell, images as displayed.
READER_PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => [i.naturalWidth, i.width]);
  const curves = [...document.querySelectorAll("svg polyline")].map(p => p.getBBox().width > 0);
  const cells = Math.max(...[...document.querySelectorAll("td")].map(c => c.getBoundingClientRect().width));
  document.body.dataset.probe = JSON.stringify({images, curves, cells, text: document.body.innerText,
                                                height: document.documentElement.scrollHeight});
});</script>"""
AUTOENCODER = {"task": "autoencoder", "args": {"kl_weight": 1e-06}, "steps": 40, "psnr_db": 27.8361, "psnr_db_baseline": 21.04,
               "held_out_samples": 8, "kl_weight": 1e-06, "held_out": True, "scaling_factor": 0.18215,
               "history": [{"step": s, "loss": 0.5 / s, "psnr_db": 20.0 + s / 5} for s in range(10, 41, 10)]}


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A finished run's folders: the record, two validation grids."""
    model_dir, health_dir = tmp_path / "model", tmp_path / "data"
    model_dir.mkdir()
    (model_dir / "atelier-training.json").write_text(json.dumps(
        {"steps": 5, "final_loss": 0.2, "weights": "ema", "history": HISTORY, "shards_seen": ["a", "b"]}))
    (health_dir / "validation").mkdir(parents=True)
    for step, colour in ((2, "red"), (5, "blue")):
        Image.new("RGB", (32, 16), colour).save(health_dir / "validation" / f"step-{step:08d}.png")
    return model_dir, health_dir


def random_picture(rng: random.Random, size: int) -> Image.Image:
    return Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))


@pytest.fixture
def rich_run(run_dir) -> tuple[Path, Path]:
    """run_dir with what a report shows besides the run: a labelled grid of 64 px samples, an
    autoencoder's record and reconstructions, the gate's document (core.deploy.evaluations) and a lineage."""
    model_dir, health_dir = run_dir
    rng = random.Random(0)
    label_grid([random_picture(rng, 64) for _ in range(4)], ["a red dog on a skateboard", "a blue cat"], [0, 7]) \
        .save(health_dir / "validation" / "step-00000005.png")
    (model_dir / "autoencoder.json").write_text(json.dumps(AUTOENCODER))
    reconstructions = Image.new("RGB", (4 * 64, 2 * 64), "white")
    for column in range(4):
        for row in range(2):
            reconstructions.paste(random_picture(rng, 64), (column * 64, row * 64))
    reconstructions.save(health_dir / "reconstructions.png")
    gate = {"decision": "held-back", "reason": "validation loss 0.3000 is 1.200x production's",
            "scores": {"eval_set": "ab12", "val_loss": "0.30000000000000004", "clip_score": None},
            "production": None, "production_model": "",
            "thresholds": {"max_loss": 1.0, "max_loss_ratio": 1.1, "min_clip_delta": -0.5}}
    (model_dir / "evaluation.json").write_text(json.dumps(
        {"model": "atelier-0123", "evaluation_job": "atelier-0123-eval", "gate": gate}))  # as core.deploy.evaluations writes it
    shard = ShardSource(shard_id="s1", key="shards/s1.tar", sha256="c" * 64, role="new", samples=3, excluded=1,
                        index_uri="s3://data/shards/s1.json")
    manifest = ManifestSource(sequence=7, digest="ab" * 32, uri="s3://data/manifests/m.json",
                              jobs=(JobSource(name="atelier-0123", stage=0, status="Completed"),), shards=(shard,),
                              left_out=(LeftOut(shard_id="s1", sha256="d" * 64, partner="partner-b", reason="revoked"),))
    samples = tuple(SampleSource(sha256=f"{n}" * 64, partner=p, license="CC-BY-4.0", bucket="uploads", key=f"{p}/{n}.png",
                                 version_id="", shards=("s1",), manifests=(7,)) for n, p in ((1, "partner-a"), (2, "partner-b")))
    (model_dir / "lineage.json").write_text(Lineage(job="atelier-0123", lineage="main", manifest="ab" * 32, artifact="s3://m/a",
                                                    manifests=(manifest,), samples=samples).model_dump_json())
    return model_dir, health_dir


class Cells(HTMLParser):
    """The text of every innermost table cell of a page, and of every SVG <text>."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []
        self.svg_texts: list[str] = []
        self._open: list[list[str]] = []
        self._in_svg_text = False

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("td", "th"):
            self._open.append([])
        if tag == "br" and self._open:
            self._open[-1].append("\n")
        self._in_svg_text = self._in_svg_text or tag == "text"

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._open:
            self.cells.append("".join(self._open.pop()).strip())
        if tag == "text":
            self._in_svg_text = False

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1].append(data)
        if self._in_svg_text:
            self.svg_texts.append(data)


def cells_of(page: str) -> Cells:
    parser = Cells()
    parser.feed(page)
    return parser


def first_rows(cells: list[str]) -> dict[str, str]:
    """The first table's rows, header to value (the page's first table has one header and one value a row)."""
    rows: dict[str, str] = {}
    for header, value in zip(cells[::2], cells[1::2]):
        rows.setdefault(header, value)
    return rows


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


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_one_renderer_is_the_trainer_s_the_cli_s_too_and_needs_only_the_standard_library() -> None:
    renderer = REPO / "trainer" / "report" / "render.py"

    names = "contracts.s3_layout"  # the file names: standard library alone (tests/unit/test_contracts.py)
    assert imported_modules(REPO / "trainer" / "report" / "write.py") - set(sys.stdlib_module_names) == {
        "trainer.report.render", names}
    assert {name.split(".")[0] for name in imported_modules(renderer) - {names}} <= set(sys.stdlib_module_names)
    assert "trainer.report.render" in imported_modules(REPO / "atelier" / "reports.py")  # `atelier report --job`


def browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def required_browser() -> str:
    """The browser; without one the test skips, except on CI (.ci/run sets CI), where it fails."""
    found = browser()
    if found is None:
        missing = "no headless Chromium on PATH (" + ", ".join(BROWSERS) + "): `make browser` (apt-get install chromium-headless-shell)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{missing}; on CI the rendering test must run, not skip")
        pytest.skip(missing)
    return found


def test_a_headless_browser_renders_every_image_and_curve(run_dir, tmp_path: Path) -> None:
    chromium = required_browser()
    (run_dir[0] / "evaluation.json").write_text(json.dumps({"decision": "pass"}))
    page = build(*run_dir, job="atelier-0123")
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    # --no-sandbox: tests may run as root (CI containers), where Chromium's sandbox refuses to start
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=60).stdout
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,1600", probe.as_uri()], capture_output=True, timeout=60)

    found = json.loads(re.search(r"data-probe=\"([^\"]*)\"", dom).group(1).replace("&quot;", '"'))
    assert found == {"images": [True, True], "curves": [True, True, True]}
    assert len(Image.open(shot).convert("RGB").getcolors(1 << 16) or ()) > 2  # drawn, not a blank page


def test_a_headless_browser_shows_a_whole_report_as_text_figures_and_labelled_pictures(rich_run, tmp_path: Path) -> None:
    # GIVEN the page of a run with every section: grids (one labelled), an autoencoder, a gate, a lineage
    chromium = required_browser()
    probe = tmp_path / "probe.html"
    probe.write_text(build(*rich_run, job="atelier-0123").replace("</body>", READER_PROBE + "</body>"))

    # WHEN a browser lays it out and takes a screenshot of the whole of it
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--window-size=1200,1600", "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=60).stdout
    found = json.loads(html.unescape(re.search(r'data-probe="([^"]*)"', dom).group(1)))
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    f"--window-size=1200,{found['height']}", probe.as_uri()], capture_output=True, timeout=60)

    # THEN every picture and curve is there, the text reads as text, and the page is a page, not a poster
    text = found["text"]
    assert [natural > 0 and shown >= 256 for natural, shown in found["images"]] == [True] * 3  # 2 grids, reconstructions
    assert found["curves"] == [True] * 5  # loss, throughput, data wait; the autoencoder's loss and PSNR
    assert "None" not in text and "{" not in text and "[" not in text and "null" not in text
    assert "step 2\n" in text and "step 5\n" in text and "originals (top) / reconstructions (bottom)" in text
    assert "27.8 dB" in text and "held-back" in text and "3.0%" in text
    assert found["cells"] < 1100 and 1500 < found["height"] < 6000
    picture = Image.open(shot).convert("L")
    assert picture.size == (1200, found["height"])
    dark_pixels = picture.point(lambda v: v < 128 and 255).histogram()[255]
    assert len(picture.getcolors(256) or ()) > 64 and dark_pixels > 20_000  # drawn: text, curves and pictures


def test_on_ci_a_missing_browser_fails_the_rendering_test_instead_of_skipping_it(tmp_path: Path) -> None:
    # GIVEN CI set and a PATH with no browser on it
    env = {**os.environ, "CI": "1", "PATH": str(Path(sys.executable).parent)}

    # WHEN the rendering test runs
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          f"{__file__}::test_a_headless_browser_renders_every_image_and_curve"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    # THEN it fails, saying why
    assert run.returncode == 1 and "1 failed" in run.stdout and "on CI the rendering test must run" in run.stdout, run.stdout


def test_the_browser_stamp_is_left_untouched_when_no_browser_could_be_installed(tmp_path: Path) -> None:
    # GIVEN no browser, not root, no apt-get: `make test`'s browser rule cannot install one
    bin_dir, stamp = tmp_path / "bin", tmp_path / "browser-stamp"
    bin_dir.mkdir()
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    (bin_dir / "id").chmod(0o755)
    (bin_dir / "touch").symlink_to(shutil.which("touch"))

    # WHEN the rule runs (the venv's own stamp taken as made)
    run = subprocess.run([shutil.which("make"), "-o", ".venv/.installed", f"BROWSER_STAMP={stamp}", str(stamp)],
                         cwd=REPO, env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)

    # THEN make goes on, and the stamp is not written: the next run tries again
    assert run.returncode == 0, run.stderr
    assert "no chromium-headless-shell" in run.stdout and not stamp.exists()
