"""trainer/report.py: one self-contained page per training job, checked in a real headless browser."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from core import training_report
from tests.support import REPO
from trainer.report import REPORT, build, write_report

# Debian's build of Chrome's headless shell: `apt-get install chromium-headless-shell` (docs/runbook.md).
BROWSERS = ("chromium-headless-shell", "chrome-headless-shell", "chromium", "google-chrome")
HISTORY = [{"step": s, "loss": 1.0 / s, "img_per_s": 100.0 + s, "data_wait_share": 0.01 * s} for s in range(1, 6)]
# Appended to a copy of the page: once it has loaded, record what the browser made of it.
PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => i.complete && i.naturalWidth > 0);
  const curves = [...document.querySelectorAll("svg polyline")].map(p => p.getBBox().width > 0);
  document.body.dataset.probe = JSON.stringify({images, curves});
});</script>"""


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

    # WHEN the page is rendered again from the output data alone (as the deploy function does)
    run = training_report.run_from_page(written)
    grids = [(p.stem, p.read_bytes()) for p in sorted((run_dir[1] / "validation").glob("*.png"))]

    # THEN it is the trainer's page: one renderer
    assert (run["steps"], run["shards_seen"], run["history"]) == (5, 2, HISTORY)
    assert training_report.page("atelier-0123", run, grids, None, None) == written


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_image_gets_the_renderer_trainer_report_imports_and_it_needs_only_the_standard_library() -> None:
    renderer = REPO / "functions" / "core" / "training_report.py"

    assert imported_modules(REPO / "trainer" / "report.py") - set(sys.stdlib_module_names) == {"core.training_report"}
    assert {name.split(".")[0] for name in imported_modules(renderer)} <= set(sys.stdlib_module_names)
    assert "COPY functions/core/__init__.py functions/core/training_report.py /opt/program/core/" \
        in (REPO / "trainer" / "Dockerfile").read_text()


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


def test_on_ci_a_missing_browser_fails_the_rendering_test_instead_of_skipping_it(tmp_path: Path) -> None:
    # GIVEN CI set and a PATH with no browser on it
    env = {**os.environ, "CI": "1", "PATH": str(Path(sys.executable).parent)}

    # WHEN the rendering test runs
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
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
