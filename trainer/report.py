"""A training job's report: one static, self-contained HTML page (inline SVG curves, PNGs as data URIs).

It shows the loss and throughput curves, the data-wait share, the validation grid of every
checkpoint, the evaluation gate's decision (`evaluation.json` beside the model, if the gate has
run) and the lineage summary (`lineage.json`, if present). Rank 0 writes it at the end of training
as `<model-dir>/report.html` and `<output-data-dir>/report.html` (which SageMaker uploads as
`output/output.tar.gz`, what `atelier report --job` reads). Rebuild it later, e.g. once the gate
has written its decision:

    python -m trainer.report --model-dir out/model [--output-data-dir out/data] [-o report.html]
"""

import argparse
import base64
import html
import json
import math
from pathlib import Path

REPORT = "report.html"
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.pass{color:#176d2c;font-weight:bold}.fail{color:#a4161a;font-weight:bold}.none{color:#777}
figure{display:inline-block;margin:0 1em 1em 0}img{max-width:100%;image-rendering:pixelated}"""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


def png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _table(rows: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_short(v))}</td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def _short(value) -> str:
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


def render(job: str, record: dict, history: list[dict], grids: list[tuple[str, str]],
           evaluation: dict | None, lineage: dict | None) -> str:
    """The page, from plain data (`grids`: (label, data URI) per checkpoint)."""
    steps = [h["step"] for h in history]
    waits = [h.get("data_wait_share") for h in history if h.get("data_wait_share") is not None]
    summary = {"steps": record.get("steps"), "final loss": record.get("final_loss"), "weights": record.get("weights"),
               "mean data-wait share": f"{sum(waits) / len(waits):.1%}" if waits else "-",
               "skipped steps": record.get("skipped_steps"),
               "corrupt samples": len(record.get("corrupt_samples") or []),
               "shards seen": len(record.get("shards_seen") or []),
               "stages": record.get("stages")}
    curves = [svg_curve(list(zip(steps, [h.get("loss") for h in history])), "training loss (log scale)", log_y=True),
              svg_curve(list(zip(steps, [h.get("img_per_s") for h in history])), "throughput (images/s)", "#2a7d2e"),
              svg_curve(list(zip(steps, [h.get("data_wait_share") for h in history])), "data-wait share", "#b5541c")]
    figures = "".join(f'<figure><img src="{uri}" alt="validation grid {html.escape(label)}">'
                      f"<figcaption>{html.escape(label)}</figcaption></figure>" for label, uri in grids) \
        or '<p class="none">no validation grids (no checkpoint, or no validation prompts)</p>'
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Training report: {html.escape(job)}'
            f"</title><style>{STYLE}</style></head><body><h1>Training report: {html.escape(job)}</h1>"
            f"<h2>Run</h2>{_table(summary)}<h2>Curves</h2>{''.join(curves)}"
            f"<h2>Validation grids</h2>{figures}"
            f"<h2>Evaluation gate</h2>{gate_section(evaluation)}"
            f"<h2>Lineage</h2>{_table(lineage) if lineage else '<p class=none>no lineage.json</p>'}"
            "</body></html>")


def build(model_dir: Path, health_dir: Path, history: list[dict] | None = None, job: str | None = None) -> str:
    """The report from what a run left: atelier-training.json, the validation grids, the JSON files."""
    record = _read_json(model_dir / "atelier-training.json") or {}
    history = history if history is not None else record.get("history", [])
    grids = [(path.stem, png_data_uri(path)) for path in sorted((health_dir / "validation").glob("step-*.png"))]
    evaluation = _read_json(model_dir / "evaluation.json")
    lineage = _read_json(model_dir / "lineage.json")
    return render(job or model_dir.name, record, history, grids, evaluation, lineage)


def write_report(model_dir: Path, health_dir: Path, history: list[dict] | None = None,
                 job: str | None = None) -> list[Path]:
    """`report.html` in the model dir and the health (output data) dir."""
    page = build(model_dir, health_dir, history, job)
    written = []
    for folder in dict.fromkeys([model_dir, health_dir]):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / REPORT).write_text(page)
        written.append(folder / REPORT)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rebuild a training run's report.html.")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--output-data-dir", type=Path, default=None, help="default <model-dir>/health")
    parser.add_argument("--job", default=None, help="the title (default: the model dir's name)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="one file instead of the two usual places")
    args = parser.parse_args()
    health = args.output_data_dir or args.model_dir / "health"
    if args.output:
        args.output.write_text(build(args.model_dir, health, job=args.job))
    else:
        write_report(args.model_dir, health, job=args.job)
