"""A training job's report: one static, self-contained HTML page (inline SVG curves, PNGs as data URIs).

It shows the loss and throughput curves (round ticks on both axes), the data-wait share, the
validation grid of every checkpoint (trainer/runtime/health.py labels each with its prompts and seeds), an
autoencoder job's figures and reconstructions, the evaluation gate's decision and the lineage
summary; every table cell reads as text (figures rounded, yes/no, an em dash for what is missing).
This module is its one renderer, standard library only (the CLI imports it without the ML stack),
for the two places that write it:

- the trainer, at the end of a run (trainer/report/write.py): `report.html` in the model and output data
  dirs, before any gate. The page carries the run's figures as a JSON data block, so that from the
  output data (`output/output.tar.gz`) alone the page can be rendered again;
- `atelier report --job` (atelier/reports.py), on demand: the complete page from output.tar.gz,
  the gate's `evaluation.json` and `lineage.json` beside the model artefact.
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

from contracts.s3_layout import REPORT_FILE

AUTOENCODER = "autoencoder.json"  # an autoencoder job's record at the model dir's root (trainer/jobs/autoencoder.py)
RECONSTRUCTIONS = "reconstructions.png"  # its originals (top row) over their reconstructions, in the output data
RUN_DATA = '<script type="application/json" id="atelier-run">'  # the run's figures, in the page itself
MISSING = "\u2014"  # an em dash: what a table shows for a value that is not there
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin-bottom:1em}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{font-weight:600;background:#f6f6f6}td{overflow-wrap:anywhere}table table{font-size:0.92em;margin:1px 0}
.pass{color:#176d2c;font-weight:bold}.fail{color:#a4161a;font-weight:bold}.none{color:#777}
svg{margin:0 1em 1em 0;font-family:system-ui,sans-serif}
figure{display:inline-block;margin:0 1em 1em 0;vertical-align:top}figcaption{color:#555;font-size:0.92em}
img{max-width:100%;image-rendering:pixelated}"""


class Html(str):
    """Text that is already HTML: a table cell shows it as it is."""


# ---------------------------------------------------------------- axes


def nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values, multiples of one 1, 2 or 5 x 10^k step, from at or below `low` to at or above
    `high`, about `count` intervals apart (whole numbers only when `integer`)."""
    if not high > low:
        pad = abs(low) / 2 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    step = max(step, 1) if integer else step
    digits = max(0, 1 - math.floor(math.log10(step)))
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(n * step, digits) for n in range(first, last + 1)]


def log_ticks(low: float, high: float) -> list[float]:
    """Tick values for a log axis over [low, high] (both above 0): decades over a wide range, values of
    1, 2 and 5 x 10^k over a narrower one, evenly spaced round values over a narrow one."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    if math.log10(high / low) > 2.5:
        every = math.ceil((last - first) / 6)
        return [float(f"1e{k}") for k in range(first, last + every, every)]
    values = [float(f"{m}e{k}") for k in range(first, last + 1) for m in (1, 2, 5)]
    below = max((v for v in values if v <= low * (1 + 1e-9)), default=values[0])
    above = min((v for v in values if v >= high * (1 - 1e-9)), default=values[-1])
    chosen = [v for v in values if below <= v <= above]
    return chosen if len(chosen) >= 3 else [t for t in nice_ticks(low, high, 4) if t > 0]


def tick_label(value: float, percent: bool = False) -> str:
    if percent:
        return f"{value * 100:g}%"
    return str(int(value)) if value == int(value) and abs(value) < 1e6 else f"{value:g}"


def svg_curve(points: list[tuple[float, float]], title: str, colour: str = "#1f4e9c", log_y: bool = False,
              size: tuple[int, int] = (520, 240), y_title: str = "", percent: bool = False) -> str:
    """A line chart as inline SVG: the points over labelled round ticks, the step along x."""
    width, height = size
    left, right, top, bottom = 66, 14, 26, 42
    plot_w, plot_h = width - left - right, height - top - bottom
    usable = [(x, y) for x, y in points if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f"<title>{html.escape(title)}</title>",
             f'<text x="{left}" y="16" font-size="13" font-weight="600">{html.escape(title)}</text>']
    if usable:
        xs, ys = [x for x, _ in usable], [y for _, y in usable]
        x_ticks = nice_ticks(min(xs), max(xs), 6, integer=True)
        y_ticks = log_ticks(min(ys), max(ys)) if log_y else nice_ticks(min(ys), max(ys), 4)
        scale = math.log10 if log_y else float
        x0, x1 = min(x_ticks[0], min(xs)), max(x_ticks[-1], max(xs))
        y0, y1 = scale(min(y_ticks[0], min(ys))), scale(max(y_ticks[-1], max(ys)))

        def px(x: float) -> float:
            return left + (x - x0) / (x1 - x0) * plot_w

        def py(y: float) -> float:
            return top + plot_h - (scale(y) - y0) / (y1 - y0) * plot_h

        for tick in x_ticks:
            parts.append(f'<line x1="{px(tick):.1f}" y1="{top + plot_h}" x2="{px(tick):.1f}" y2="{top + plot_h + 5}" '
                         f'stroke="#666"/><text x="{px(tick):.1f}" y="{top + plot_h + 17}" font-size="11" '
                         f'text-anchor="middle">{tick_label(tick)}</text>')
        for tick in y_ticks:
            parts.append(f'<line x1="{left}" y1="{py(tick):.1f}" x2="{left + plot_w}" y2="{py(tick):.1f}" '
                         'stroke="#eee"/>'
                         f'<line x1="{left - 5}" y1="{py(tick):.1f}" x2="{left}" y2="{py(tick):.1f}" stroke="#666"/>'
                         f'<text x="{left - 8}" y="{py(tick) + 4:.1f}" font-size="11" text-anchor="end">'
                         f"{tick_label(tick, percent)}</text>")
        coordinates = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in usable)
        parts.append(f'<polyline points="{coordinates}" fill="none" stroke="{colour}" stroke-width="2"/>')
        if len(usable) == 1:
            parts.append(f'<circle cx="{px(xs[0]):.1f}" cy="{py(ys[0]):.1f}" r="3" fill="{colour}"/>')
    else:
        parts.append(f'<text x="{left + 10}" y="{top + plot_h // 2}" font-size="12" fill="#777">no data</text>')
    parts += [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>',
              f'<text x="{left + plot_w / 2:.0f}" y="{height - 6}" font-size="12" text-anchor="middle">step</text>',
              f'<text x="14" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
              f'transform="rotate(-90 14 {top + plot_h / 2:.0f})">{html.escape(y_title)}</text>', "</svg>"]
    return "".join(parts)


# ---------------------------------------------------------------- tables


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _label(key: Any) -> str:
    return re.sub(r"\bkl\b", "KL", str(key).replace("psnr_db", "PSNR").replace("_", " "))


def _number(label: str, value: float) -> str:
    """A figure rounded for reading; the row's label says what kind (a share, a PSNR, a rate)."""
    if not math.isfinite(value):
        return "not finite"
    hint = label.lower()
    if "share" in hint:
        return f"{value:.1%}"
    if "psnr" in hint:
        return f"{value:.1f} dB"
    if any(rate in hint for rate in ("img/s", "images/s", "per s")):
        return f"{value:.1f}"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float))


def _cell(label: str, value: Any) -> str:
    """One value as HTML: figures rounded, yes/no, lists as text, nested documents as small tables."""
    if isinstance(value, Html):
        return value
    if value is None or value == "" or value == [] or value == {}:
        return f'<span class="none">{MISSING}</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return _number(label, value)
    if isinstance(value, str):  # a float kept as text (DynamoDB items, core.deploy.gate.Scores.to_item) reads as one
        numeric = re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+[eE][-+]?\d+)([eE][-+]?\d+)?", value.strip())
        return _number(label, float(value)) if numeric else html.escape(value)
    if isinstance(value, dict):
        if all(isinstance(v, dict) for v in value.values()):
            return _columns([(_label(k), v) for k, v in value.items()])
        if all(_scalar(v) for v in value.values()):
            return "<br>".join(f"{html.escape(_label(k))}: {_cell(_label(k), v)}" for k, v in value.items())
        return _table(value)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, dict) for v in value):
            return _columns([(None, v) for v in value])
        shown = [_cell(label, v) for v in value[:8]]
        more = f", \u2026 ({len(value)} in all)" if len(value) > 8 else ""
        return (", " if all(_scalar(v) for v in value) else "<br>").join(shown) + more
    return html.escape(str(value))


def _columns(rows: list[tuple[str | None, dict]]) -> str:
    """Documents of much the same fields as one table: a row each, a column per field."""
    fields = list(dict.fromkeys(k for _, row in rows for k in row))
    named = any(name is not None for name, _ in rows)
    head = ("<th></th>" if named else "") + "".join(f"<th>{html.escape(_label(k))}</th>" for k in fields)
    body = "".join("<tr>" + (f"<th>{html.escape(name or '')}</th>" if named else "")
                   + "".join(f"<td>{_cell(_label(k), row.get(k))}</td>" for k in fields) + "</tr>"
                   for name, row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _table(rows: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(_label(k))}</th><td>{_cell(_label(k), v)}</td></tr>"
                    for k, v in rows.items())
    return f"<table>{cells}</table>"


# ---------------------------------------------------------------- sections


def gate_section(evaluation: dict | None) -> str:
    """The gate's decision: `gate` block or the file itself, `decision` / `passed` read leniently."""
    if evaluation is None:
        return '<p class="none">not evaluated</p>'
    gate = evaluation["gate"] if isinstance(evaluation.get("gate"), dict) else evaluation
    passed = {True: "pass", False: "fail"}.get(gate.get("passed")) if "passed" in gate else None
    decision = gate.get("decision") or passed
    css = {"pass": "pass", "passed": "pass", "deploy": "pass", "fail": "fail", "failed": "fail",
           "reject": "fail", "rejected": "fail", "held-back": "fail"}.get(str(decision).lower(), "none")
    head = (f'<p>decision: <span class="{css}">{html.escape(str(decision))}</span></p>' if decision
            else '<p class="none">no gate decision yet</p>')
    rows = {k: v for k, v in gate.items() if k != "decision"}
    for key, value in evaluation.items():
        if gate is not evaluation and key != "gate":
            rows[key if key not in rows else f"document {key}"] = value
    return head + _table(rows)


def lineage_section(lineage: dict | None) -> str:
    """lineage.json (core.provenance.Lineage) in a few rows: each manifest with its jobs, the samples
    by partner and license; any other document as it is."""
    if not lineage:
        return '<p class="none">no lineage.json</p>'
    rows = {k: v for k, v in lineage.items() if k not in ("manifests", "samples")}
    manifests, samples = lineage.get("manifests"), lineage.get("samples")
    if isinstance(manifests, list):
        rows["manifests"] = Html("<br>".join(html.escape(
            f"#{m.get('sequence')} {str(m.get('digest', ''))[:12]}: "
            f"jobs {', '.join(j.get('name', '') for j in m.get('jobs', []))}; "
            f"shards {len(m.get('shards', []))}, left out {len(m.get('left_out', []))}") for m in manifests))
    if isinstance(samples, list):
        by_source = Counter((s.get("partner") or "?", s.get("license") or "?") for s in samples)
        rows["samples"] = len(samples)
        rows["samples by partner / license"] = ", ".join(f"{p} / {lic}: {n}"
                                                         for (p, lic), n in sorted(by_source.items()))
    return _table(rows)


def _figure(uri: str, alt: str, caption: str, min_height: int = 256) -> str:
    """A picture, shown at a whole multiple of its size so that a small one is at least `min_height` high."""
    try:
        header = base64.b64decode(uri.partition(",")[2][:32] + "==")[:24]
    except ValueError:  # binascii.Error: not base64 at all; shown as it is
        header = b""
    zoom, size = 1, ""
    if header[:8] == b"\x89PNG\r\n\x1a\n":
        width, height = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
        zoom = max(1, min(min_height // max(height, 1), 1000 // max(width, 1)))
        size = f' width="{width * zoom}" height="{height * zoom}"' if zoom > 1 else ""
    return (f'<figure><img src="{uri}"{size} alt="{html.escape(alt)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _grid_caption(label: str) -> str:
    found = re.fullmatch(r"step-0*(\d+)", label)
    return f"step {int(found.group(1))}" if found else label


def autoencoder_section(record: dict | None, reconstructions: str | None) -> str:
    """An autoencoder job's figures (autoencoder.json), its curves, and its reconstructions beside the originals."""
    record = record or {}
    first = ("psnr_db", "psnr_db_baseline", "held_out_samples", "steps", "kl_weight")
    rows = {k: record.get(k) for k in first if k in record or k in ("psnr_db", "steps")}
    rows |= {k: v for k, v in record.items() if k not in rows and k not in ("args", "history")}
    history = [h for h in record.get("history") or [] if isinstance(h, dict) and "step" in h]
    curves = [svg_curve([(h["step"], h.get("loss")) for h in history], "autoencoder loss (log scale)", log_y=True,
                        y_title="loss"),
              svg_curve([(h["step"], h.get("psnr_db")) for h in history], "reconstruction PSNR", "#6a3d9a",
                        y_title="dB")] \
        if history else []
    picture = (_figure(reconstructions, "autoencoder reconstructions", "originals (top) / reconstructions (bottom)")
               if reconstructions else '<p class="none">no reconstructions.png</p>')
    return (_table(rows) if record else '<p class="none">no autoencoder.json</p>') + "".join(curves) + "<br>" + picture


def run_data(record: dict, history: list[dict] | None = None, autoencoder: dict | None = None,
             tokenization: dict | None = None) -> dict:
    """What the page shows of a run's record (atelier-training.json) and of an autoencoder job's
    (autoencoder.json, less its args)."""
    run = {"steps": record.get("steps"), "final_loss": record.get("final_loss"), "weights": record.get("weights"),
           "skipped_steps": record.get("skipped_steps"), "corrupt_samples": len(record.get("corrupt_samples") or []),
           "shards_seen": len(record.get("shards_seen") or []), "stages": record.get("stages"),
           "history": history if history is not None else record.get("history") or []}
    if autoencoder:
        run["autoencoder"] = {k: v for k, v in autoencoder.items() if k != "args"}
    if record.get("tokenizer") or tokenization:
        run["tokenizer"] = record.get("tokenizer") or tokenization
    return run


def tokenizer_section(tokenization: dict) -> str:
    """Where the tokenizers came from and, per pipeline folder, how the captions tokenized (trainer/models/text_tokenizers.py)."""
    rows = {k: v for k, v in tokenization.items() if k != "tokenizers"}
    for name, figures in (tokenization.get("tokenizers") or {}).items():
        rows[name] = ", ".join(f"{_label(k)} {v}" for k, v in figures.items())
    return _table(rows)


def run_from_page(page: str) -> dict | None:
    """The run's figures a page carries (None: a page from before they were carried)."""
    found = re.search(re.escape(RUN_DATA) + r"(.*?)</script>", page, re.S)
    return json.loads(found.group(1)) if found else None


def _run_sections(run: dict, grids: list[tuple[str, str]]) -> str:
    history = run.get("history") or []
    steps = [h["step"] for h in history]

    def mean(field: str) -> float | None:
        values = [h[field] for h in history if isinstance(h.get(field), (int, float))]
        return sum(values) / len(values) if values else None
    summary = {"steps": run.get("steps"), "final loss": run.get("final_loss"), "weights": run.get("weights"),
               "mean throughput (img/s)": mean("img_per_s"), "mean data-wait share": mean("data_wait_share"),
               "skipped steps": run.get("skipped_steps"), "corrupt samples": run.get("corrupt_samples"),
               "shards seen": run.get("shards_seen"), "stages": run.get("stages"),
               "captions cut at the context length": max((f.get("cut_share") or 0 for f in (run.get("tokenizer") or {})
                                                          .get("tokenizers", {}).values()), default=None)}
    curves = [svg_curve(list(zip(steps, [h.get("loss") for h in history])), "training loss (log scale)", log_y=True,
                        y_title="loss"),
              svg_curve(list(zip(steps, [h.get("img_per_s") for h in history])), "throughput", "#2a7d2e",
                        y_title="images/s"),
              svg_curve(list(zip(steps, [h.get("data_wait_share") for h in history])), "data-wait share", "#b5541c",
                        y_title="share of step time", percent=True)]
    figures = "".join(_figure(uri, f"validation grid {label}", _grid_caption(label)) for label, uri in grids) \
        or '<p class="none">no validation grids (no checkpoint, or no validation prompts)</p>'
    return (f"<h2>Run</h2>{_table(summary)}<h2>Curves</h2>{''.join(curves)}"
            f"<h2>Validation grids</h2><p>one row per prompt, one column per seed</p>{figures}")


def render(job: str, run: dict, grids: list[tuple[str, str]], evaluation: dict | None, lineage: dict | None,
           reconstructions: str | None = None) -> str:
    """The page, from plain data (`run`: run_data; `grids`: (label, data URI) per checkpoint;
    `reconstructions`: an autoencoder job's picture as a data URI)."""
    autoencoder = run.get("autoencoder")
    trained = run.get("steps") is not None or run.get("history") or not (autoencoder or reconstructions
                                                                        or run.get("tokenizer"))
    carried = json.dumps(run, separators=(",", ":")).replace("<", "\\u003c")  # nothing in it can end the block
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Training report: {html.escape(job)}'
            f"</title><style>{STYLE}</style>{RUN_DATA}{carried}</script></head>"
            f"<body><h1>Training report: {html.escape(job)}</h1>"
            + (_run_sections(run, grids) if trained else "")
            + (f"<h2>Autoencoder</h2>{autoencoder_section(autoencoder, reconstructions)}"
               if autoencoder or reconstructions else "")
            + (f"<h2>Tokenizer</h2>{tokenizer_section(run['tokenizer'])}" if run.get("tokenizer") else "")
            + f"<h2>Evaluation gate</h2>{gate_section(evaluation)}"
            f"<h2>Lineage</h2>{lineage_section(lineage)}"
            "</body></html>")


def read_output(stream: IO[bytes]) -> tuple[dict | None, list[tuple[str, bytes]]]:
    """The run's figures (from the trainer's page) and the pictures (label, PNG) of a job's
    output.tar.gz, read front to back: the validation grids, and an autoencoder job's
    reconstructions.png (label `reconstructions`, which `page` shows in its own section)."""
    run, grids = None, []
    with tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            path = PurePosixPath(member.name.removeprefix("./"))
            grid = str(path.parent) == "validation" and path.match("step-*.png")
            wanted = str(path) in (REPORT_FILE, RECONSTRUCTIONS) or grid
            extracted = tar.extractfile(member) if member.isfile() and wanted else None
            if extracted is None:
                continue
            if str(path) == REPORT_FILE:
                run = run_from_page(extracted.read().decode())
            else:
                grids.append((path.stem, extracted.read()))
    return run, sorted(grids)


def page(job: str, run: dict | None, grids: list[tuple[str, bytes]], evaluation: dict | None,
         lineage: dict | None) -> str:
    """The page from what a job left in S3 (read_output), the gate's document and lineage.json."""
    named = PurePosixPath(RECONSTRUCTIONS).stem
    reconstructions = next((png_data_uri(png) for label, png in grids if label == named), None)
    return render(job, run or run_data({}), [(label, png_data_uri(png)) for label, png in grids if label != named],
                  evaluation, lineage, reconstructions)
