"""A training job's report: one static, self-contained HTML page (inline SVG curves, PNGs as data URIs).

It shows the loss and throughput curves, the data-wait share, the validation grid of every
checkpoint, the evaluation gate's decision and the lineage summary. This module is its one
renderer, standard library only, for the two places that write it:

- the trainer, at the end of a run (trainer/report.py; trainer/Dockerfile copies this file into the
  image): `report.html` in the model and output data dirs, before any gate. The page carries the
  run's figures as a JSON data block, so that from the output data (`output/output.tar.gz`) alone
  the page can be rendered again;
- the deploy function, once the gate has decided (core.deploy): `report.html` as its own object
  beside the model artefact, from output.tar.gz, the decision and lineage.json.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import tarfile
from collections import Counter
from pathlib import PurePosixPath
from typing import IO, Any

REPORT = "report.html"
RECORD = "atelier-training.json"  # the run's record at the model dir's root (trainer/train.py)
RUN_DATA = '<script type="application/json" id="atelier-run">'  # the run's figures, in the page itself
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.pass{color:#176d2c;font-weight:bold}.fail{color:#a4161a;font-weight:bold}.none{color:#777}
figure{display:inline-block;margin:0 1em 1em 0}img{max-width:100%;image-rendering:pixelated}"""


def svg_curve(points: list[tuple[float, float]], title: str, colour: str = "#1f4e9c", log_y: bool = False,
              size: tuple[int, int] = (520, 220)) -> str:
    """A line chart as inline SVG: the points, the axis ranges written at the corners."""
    width, height, margin = *size, 44
    usable = [(x, y) for x, y in points if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f"<title>{html.escape(title)}</title>",
             f'<rect x="{margin}" y="10" width="{width - margin - 10}" height="{height - margin - 10}" '
             'fill="none" stroke="#999"/>',
             f'<text x="{margin}" y="{height - 8}" font-size="11">{html.escape(title)}</text>']
    if usable:
        xs = [x for x, _ in usable]
        ys = [math.log10(y) if log_y else y for _, y in usable]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        y0, y1 = min(ys), max(max(ys), min(ys) + 1e-9)

        def place(x: float, y: float) -> str:
            px = margin + (x - x0) / (x1 - x0) * (width - margin - 10)
            py = height - margin - (y - y0) / (y1 - y0) * (height - margin - 20)
            return f"{px:.1f},{py:.1f}"

        coordinates = " ".join(place(x, y) for x, y in zip(xs, ys))
        parts.append(f'<polyline points="{coordinates}" fill="none" stroke="{colour}" stroke-width="2"/>')
        if len(usable) == 1:
            parts.append(f'<circle cx="{coordinates.split(",")[0]}" cy="{coordinates.split(",")[1]}" r="3" '
                         f'fill="{colour}"/>')
        top, bottom = (10 ** y1, 10 ** y0) if log_y else (y1, y0)
        parts += [f'<text x="2" y="20" font-size="10">{top:.4g}</text>',
                  f'<text x="2" y="{height - margin}" font-size="10">{bottom:.4g}</text>',
                  f'<text x="{margin}" y="{height - margin + 14}" font-size="10">step {x0:g}</text>',
                  f'<text x="{width - 80}" y="{height - margin + 14}" font-size="10">step {max(xs):g}</text>']
    else:
        parts.append(f'<text x="{margin + 10}" y="{height // 2}" font-size="12" fill="#777">no data</text>')
    parts.append("</svg>")
    return "".join(parts)


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _table(rows: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_short(v))}</td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"{len(value)} items: " + ", ".join(str(v) for v in value[:8]) + ", ..."
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def gate_section(evaluation: dict | None) -> str:
    """The gate's decision: `gate` block or the file itself, `decision` / `passed` read leniently."""
    if evaluation is None:
        return '<p class="none">not evaluated</p>'
    gate = evaluation.get("gate", evaluation) if isinstance(evaluation.get("gate"), dict) else evaluation
    decision = gate.get("decision") or ({True: "pass", False: "fail"}.get(gate.get("passed")) if "passed" in gate else None)
    css = {"pass": "pass", "passed": "pass", "deploy": "pass", "fail": "fail", "failed": "fail",
           "reject": "fail", "rejected": "fail", "held-back": "fail"}.get(str(decision).lower(), "none")
    head = f'<p>decision: <span class="{css}">{html.escape(str(decision or "unknown"))}</span></p>'
    return head + _table({k: v for k, v in evaluation.items() if k != "gate"} | {
        f"gate.{k}": v for k, v in gate.items() if gate is not evaluation and k != "decision"})


def lineage_section(lineage: dict | None) -> str:
    """lineage.json (core.provenance.Lineage) in a few rows: each manifest with its jobs, the samples
    by partner and license; any other document as it is."""
    if not lineage:
        return '<p class="none">no lineage.json</p>'
    rows = {k: v for k, v in lineage.items() if k not in ("manifests", "samples")}
    manifests, samples = lineage.get("manifests"), lineage.get("samples")
    if isinstance(manifests, list):
        rows["manifests"] = "; ".join(
            f"#{m.get('sequence')} {str(m.get('digest', ''))[:12]}: jobs {', '.join(j.get('name', '') for j in m.get('jobs', []))}; "
            f"shards {len(m.get('shards', []))}, left out {len(m.get('left_out', []))}" for m in manifests)
    if isinstance(samples, list):
        by_source = Counter((s.get("partner") or "?", s.get("license") or "?") for s in samples)
        rows["samples"] = len(samples)
        rows["samples by partner / license"] = ", ".join(f"{p} / {lic}: {n}" for (p, lic), n in sorted(by_source.items()))
    return _table(rows)


def run_data(record: dict, history: list[dict] | None = None) -> dict:
    """What the page shows of a run's record (atelier-training.json)."""
    return {"steps": record.get("steps"), "final_loss": record.get("final_loss"), "weights": record.get("weights"),
            "skipped_steps": record.get("skipped_steps"), "corrupt_samples": len(record.get("corrupt_samples") or []),
            "shards_seen": len(record.get("shards_seen") or []), "stages": record.get("stages"),
            "history": history if history is not None else record.get("history") or []}


def run_from_page(page: str) -> dict | None:
    """The run's figures a page carries (None: a page from before they were carried)."""
    found = re.search(re.escape(RUN_DATA) + r"(.*?)</script>", page, re.S)
    return json.loads(found.group(1)) if found else None


def render(job: str, run: dict, grids: list[tuple[str, str]], evaluation: dict | None, lineage: dict | None) -> str:
    """The page, from plain data (`run`: run_data; `grids`: (label, data URI) per checkpoint)."""
    history = run.get("history") or []
    steps = [h["step"] for h in history]
    waits = [h.get("data_wait_share") for h in history if h.get("data_wait_share") is not None]
    summary = {"steps": run.get("steps"), "final loss": run.get("final_loss"), "weights": run.get("weights"),
               "mean data-wait share": f"{sum(waits) / len(waits):.1%}" if waits else "-",
               "skipped steps": run.get("skipped_steps"), "corrupt samples": run.get("corrupt_samples"),
               "shards seen": run.get("shards_seen"), "stages": run.get("stages")}
    curves = [svg_curve(list(zip(steps, [h.get("loss") for h in history])), "training loss (log scale)", log_y=True),
              svg_curve(list(zip(steps, [h.get("img_per_s") for h in history])), "throughput (images/s)", "#2a7d2e"),
              svg_curve(list(zip(steps, [h.get("data_wait_share") for h in history])), "data-wait share", "#b5541c")]
    figures = "".join(f'<figure><img src="{uri}" alt="validation grid {html.escape(label)}">'
                      f"<figcaption>{html.escape(label)}</figcaption></figure>" for label, uri in grids) \
        or '<p class="none">no validation grids (no checkpoint, or no validation prompts)</p>'
    carried = json.dumps(run, separators=(",", ":")).replace("<", "\\u003c")  # nothing in it can end the block
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Training report: {html.escape(job)}'
            f"</title><style>{STYLE}</style>{RUN_DATA}{carried}</script></head>"
            f"<body><h1>Training report: {html.escape(job)}</h1>"
            f"<h2>Run</h2>{_table(summary)}<h2>Curves</h2>{''.join(curves)}"
            f"<h2>Validation grids</h2>{figures}"
            f"<h2>Evaluation gate</h2>{gate_section(evaluation)}"
            f"<h2>Lineage</h2>{lineage_section(lineage)}"
            "</body></html>")


def read_output(stream: IO[bytes]) -> tuple[dict | None, list[tuple[str, bytes]]]:
    """The run's figures (from the trainer's page) and the validation grids (label, PNG) of a job's
    output.tar.gz, read front to back."""
    run, grids = None, []
    with tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            path = PurePosixPath(member.name.removeprefix("./"))
            wanted = str(path) == REPORT or (str(path.parent) == "validation" and path.match("step-*.png"))
            extracted = tar.extractfile(member) if member.isfile() and wanted else None
            if extracted is None:
                continue
            if str(path) == REPORT:
                run = run_from_page(extracted.read().decode())
            else:
                grids.append((path.stem, extracted.read()))
    return run, sorted(grids)


def page(job: str, run: dict | None, grids: list[tuple[str, bytes]], evaluation: dict | None,
         lineage: dict | None) -> str:
    """The page from what a job left in S3 (read_output), the gate's document and lineage.json."""
    return render(job, run or run_data({}), [(label, png_data_uri(png)) for label, png in grids], evaluation, lineage)
