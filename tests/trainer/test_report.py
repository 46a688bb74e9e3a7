"""trainer/report.py: one self-contained page per training job, checked in a real headless browser."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

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


def browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


@pytest.mark.skipif(browser() is None, reason="no headless Chromium on PATH (" + ", ".join(BROWSERS)
                    + "); on Debian/Ubuntu: apt-get install chromium-headless-shell")
def test_a_headless_browser_renders_every_image_and_curve(run_dir, tmp_path: Path) -> None:
    (run_dir[0] / "evaluation.json").write_text(json.dumps({"decision": "pass"}))
    page = build(*run_dir, job="atelier-0123")
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    # --no-sandbox: tests may run as root (CI containers), where Chromium's sandbox refuses to start
    dom = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=60).stdout
    shot = tmp_path / "shot.png"
    subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,1600", probe.as_uri()], capture_output=True, timeout=60)

    found = json.loads(re.search(r"data-probe=\"([^\"]*)\"", dom).group(1).replace("&quot;", '"'))
    assert found == {"images": [True, True], "curves": [True, True, True]}
    assert len(Image.open(shot).convert("RGB").getcolors(1 << 16) or ()) > 2  # drawn, not a blank page
