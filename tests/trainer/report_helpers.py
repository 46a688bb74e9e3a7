"""What the training report tests share: a run's folder with figures and grids, the page's table cells."""

import json
import random
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from contracts.messages import LeftOut
from core.provenance import JobSource, Lineage, ManifestSource, SampleSource, ShardSource
from trainer.runtime.health import label_grid

HISTORY = [{"step": s, "loss": 1.0 / s, "img_per_s": 100.0 + s, "data_wait_share": 0.01 * s} for s in range(1, 6)]
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
