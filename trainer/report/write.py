"""A training job's report at the end of its run (the page itself: trainer/report/render.py, the one
renderer, which `atelier report --job` uses too).

Rank 0 writes `<model-dir>/report.html` and `<output-data-dir>/report.html`; the page carries the
run's figures. An autoencoder job (trainer/jobs/autoencoder.py) calls the same `write_report`: its
`autoencoder.json` and `reconstructions.png` make the page's Autoencoder section. SageMaker uploads
the output data dir, validation grids and all, as `output/output.tar.gz`, from which
`atelier report --job` renders the complete page, with the gate's decision (`evaluation.json`) and
the lineage (`lineage.json`) the pipeline writes beside the model artefact. Rebuild it locally,
e.g. with an `evaluation.json` and a `lineage.json` put into the model dir:

    python -m trainer.report.write --model-dir out/model [--output-data-dir out/data] [-o report.html]
"""

import argparse
import json
from pathlib import Path

from contracts.s3_layout import EVALUATION_FILE, LINEAGE_FILE, REPORT_FILE, TRAINING_RECORD
from trainer.report.render import AUTOENCODER, RECONSTRUCTIONS, png_data_uri, render, run_data

TOKENIZATION = "tokenization.json"  # a tokenizer job's figures (trainer/models/text_tokenizers.REPORT)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(model_dir: Path, health_dir: Path, history: list[dict] | None = None, job: str | None = None) -> str:
    """The report from what a run left: atelier-training.json or autoencoder.json, the validation grids
    or the reconstructions, the JSON files."""
    run = run_data(_read_json(model_dir / TRAINING_RECORD) or {}, history, _read_json(model_dir / AUTOENCODER),
                   _read_json(model_dir / TOKENIZATION))
    grids = [(path.stem, png_data_uri(path.read_bytes()))
             for path in sorted((health_dir / "validation").glob("step-*.png"))]
    pictured = health_dir / RECONSTRUCTIONS
    reconstructions = png_data_uri(pictured.read_bytes()) if pictured.is_file() else None
    return render(job or model_dir.name, run, grids, _read_json(model_dir / EVALUATION_FILE),
                  _read_json(model_dir / LINEAGE_FILE), reconstructions)


def write_report(model_dir: Path, health_dir: Path, history: list[dict] | None = None,
                 job: str | None = None) -> list[Path]:
    """`report.html` in the model dir and the health (output data) dir."""
    page = build(model_dir, health_dir, history, job)
    written = []
    for folder in dict.fromkeys([model_dir, health_dir]):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / REPORT_FILE).write_text(page)
        written.append(folder / REPORT_FILE)
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
