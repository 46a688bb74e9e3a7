"""trainer/report/write.py's page in a real headless browser, and the one renderer the trainer and CLI share."""

import ast
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.support import REPO
from trainer.report.write import build
from tests.trainer.report_helpers import rich_run, run_dir  # noqa: F401  (run_dir, rich_run: fixtures)


# Debian's build of Chrome's headless shell: `apt-get install chromium-headless-shell` (docs/runbook.md).
BROWSERS = ("chromium-headless-shell", "chrome-headless-shell", "chromium", "google-chrome")


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
