"""Attribution per model: for each partner and license, the unique samples its manifests held and
the samples its trainer actually drew (docs/provenance.md).

The draws are the trainer's own counts (`draws` in atelier-training.json, summed over ranks and
carried through checkpoints), read from the job's model.tar.gz by streaming up to that member.
`record_model` writes lineage.json, attribution.json and attribution.png beside the model; the
attribution URI is what generated images point to (the deploy function sets it as
ATELIER_ATTRIBUTION_URI on the endpoint).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

from PIL import Image, ImageDraw

from contracts.messages import Frozen
from contracts.s3_layout import (ATTRIBUTION_CHART, ATTRIBUTION_FILE, LINEAGE_FILE, MODEL_ARCHIVE, TRAINING_RECORD, output_key,
                                 output_uri)
from core import aws
from core.provenance import Lineage, Places, lineage_of

ATTRIBUTION_SCHEMA = 1
UNKNOWN = "unknown"  # a sample whose record names no partner or license


class Share(Frozen):
    partner: str
    license: str
    samples: int  # unique samples of this partner and license in the model's manifests
    draws: int | None  # samples of it the trainer drew (None: no counts from the trainer)
    sample_share: float
    draw_share: float | None


class Attribution(Frozen):
    """attribution.json."""

    schema_version: int = ATTRIBUTION_SCHEMA
    job: str
    lineage_uri: str
    samples: int
    draws: int | None
    shares: tuple[Share, ...]  # sorted by partner, then license


def attribution(lineage: Lineage, draws: dict[str, dict[str, int]] | None, lineage_uri: str) -> Attribution:
    """The model's shares per partner and license, of its samples and of the trainer's draws."""
    held = Counter((s.partner or UNKNOWN, s.license or UNKNOWN) for s in lineage.samples)
    drawn = Counter({(partner or UNKNOWN, license or UNKNOWN): int(n)
                     for partner, licenses in (draws or {}).items() for license, n in licenses.items()})
    total_samples, total_draws = sum(held.values()), sum(drawn.values())
    shares = tuple(Share(partner=partner, license=license, samples=held[(partner, license)],
                         draws=drawn[(partner, license)] if draws is not None else None,
                         sample_share=round(held[(partner, license)] / total_samples, 6) if total_samples else 0.0,
                         draw_share=(round(drawn[(partner, license)] / total_draws, 6) if total_draws else 0.0)
                         if draws is not None else None)
                   for partner, license in sorted(set(held) | set(drawn)))
    return Attribution(job=lineage.job, lineage_uri=lineage_uri, samples=total_samples,
                       draws=total_draws if draws is not None else None, shares=shares)


def read_draws(models_bucket: str, job: str) -> dict[str, dict[str, int]] | None:
    """`draws` from atelier-training.json in the job's model.tar.gz, streamed up to that member;
    None when there is no artefact or the trainer recorded no counts."""
    key = output_key(job, MODEL_ARCHIVE)
    # a listing, not a HeadObject: S3 answers a HEAD of a missing key with 403 to a role whose
    # ListBucket is limited by prefix (StartTrainingFunction's), and the event would retry forever
    if not aws.has_objects(models_bucket, key):
        return None
    _, body = aws.open_object(models_bucket, key)
    try:
        with tarfile.open(fileobj=body, mode="r|gz") as tar:
            for member in tar:
                if member.isfile() and member.name.removeprefix("./") == TRAINING_RECORD:
                    draws = json.load(tar.extractfile(member)).get("draws")  # type: ignore[arg-type]
                    return draws if isinstance(draws, dict) else None
    finally:
        body.close()
    return None


def chart(report: Attribution) -> bytes:
    """A PNG of the shares: per partner and license, its share of the samples and of the draws."""
    row, left, width = 26, 240, 360
    image = Image.new("RGB", (left + width + 80, 56 + row * max(1, len(report.shares))), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 6), f"{report.job}: {report.samples} samples, {report.draws if report.draws is not None else '?'} draws",
              fill="black")
    draw.rectangle((left, 24, left + 10, 32), fill=(52, 101, 164))
    draw.text((left + 14, 22), "share of samples", fill="black")
    draw.rectangle((left + 150, 24, left + 160, 32), fill=(245, 121, 0))
    draw.text((left + 164, 22), "share of draws", fill="black")
    for n, share in enumerate(report.shares):
        top = 44 + n * row
        draw.text((8, top + 4), f"{share.partner} / {share.license}"[:38], fill="black")
        draw.rectangle((left, top, left + round(width * share.sample_share), top + 9), fill=(52, 101, 164))
        if share.draw_share is not None:
            draw.rectangle((left, top + 11, left + round(width * share.draw_share), top + 20), fill=(245, 121, 0))
        draw.text((left + width + 8, top + 4), f"{share.sample_share:.0%}", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def record_model(job: str, places: Places) -> Attribution:
    """Write lineage.json, attribution.json and attribution.png beside the job's model (idempotent:
    a redelivered Completed event writes them again from the same records)."""
    lineage = lineage_of(job, places)
    lineage_uri = output_uri(places.models_bucket, job, LINEAGE_FILE)
    report = attribution(lineage, read_draws(places.models_bucket, job), lineage_uri)
    aws.write_object(places.models_bucket, output_key(job, LINEAGE_FILE),
                     lineage.model_dump_json(indent=1).encode(), "application/json")
    aws.write_object(places.models_bucket, output_key(job, ATTRIBUTION_FILE),
                     report.model_dump_json(indent=1).encode(), "application/json")
    aws.write_object(places.models_bucket, output_key(job, ATTRIBUTION_CHART), chart(report), "image/png")
    return report
