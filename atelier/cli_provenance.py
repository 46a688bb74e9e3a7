"""`atelier` commands for lineage, takedowns, attribution (docs/provenance.md)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from atelier import client, operator_requests
from contracts import s3_layout

if TYPE_CHECKING:
    from core.provenance import Lineage

console = Console()


def cmd_lineage(args: argparse.Namespace) -> int:
    if args.model == "resume":
        return cmd_lineage_resume(args)
    if args.name:
        raise SystemExit(f"atelier lineage: unexpected {args.name!r} after the model (did you mean `lineage resume NAME`?)")
    found = client.lineage(client.stack_outputs(args.stack), args.model)
    if args.json:
        print(found.model_dump_json(indent=1))
        return 0
    table = Table(title=f"{args.model}: learned from (training job {found.job}, lineage {found.lineage})")
    for column in ("manifest", "digest", "jobs", "shards", "excluded"):
        table.add_column(column)
    for manifest in found.manifests:
        table.add_row(str(manifest.sequence), manifest.digest[:16],
                      ", ".join(f"{j.name} ({j.status})" for j in manifest.jobs),
                      str(len(manifest.shards)), str(sum(s.excluded for s in manifest.shards)))
    console.print(table)
    counts = Counter((s.partner, s.license or "?") for s in found.samples)
    console.print(f"{len(found.samples)} samples: " + ", ".join(
        f"{partner}/{license} {n}" for (partner, license), n in sorted(counts.items())))
    for line in model_parts(found):
        console.print(line)
    console.print("--json lists every shard and sample (sha256, partner, license, upload key and version)")
    return 0


def cmd_lineage_resume(args: argparse.Namespace) -> int:
    """`atelier lineage resume NAME`: lift the failure brake of a halted (or backing-off) lineage."""
    if not args.name:
        raise SystemExit("atelier lineage resume: name the lineage (TrainingLineage; `atelier status` shows it)")
    result = operator_requests.resume_lineage(client.stack_outputs(args.stack), args.name)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    last = result["last_failure"]
    state = "was halted" if result["was_halted"] else (
        f"was backing off ({result['was_backing_off_s']} s left)" if result["was_backing_off_s"] else "was not held")
    console.print(f"lineage {args.name} resumed ({state}; {result['model_failures']} failed jobs in a row)"
                  + (f"; last failure: {last['job']}: {last['reason']}" if last else ""))
    console.print("the next job starts now if its shards are due")
    return 0


def model_parts(found: Lineage) -> list[str]:
    """The pretrained base and the VAE the model started from, one line each (and the lineage's tokenizer job's)."""
    base = found.pretrained
    lines = [f"base: {base.uri} ({base.kind}, {base.objects} objects, {base.size} bytes, "
             f"{'sha256' if base.kind == 'prefix' else 'ETag'} {base.digest})" if base else "base: none (random parts)"]
    vae = found.vae
    if vae is None:
        lines.append("VAE: not recorded (lineage.json before schema 2)")
    elif vae.source == "autoencoder":
        lines.append(f"VAE: {vae.uri} (autoencoder job {vae.autoencoder_job})" if vae.uri
                     else "VAE: the lineage's autoencoder job has not completed yet")
    else:
        lines.append("VAE: the base's" if vae.source == "base" else "VAE: random (frozen)")
    if found.tokenizer is not None and found.tokenizer.source == "tokenizer-job":  # else the base's, or the job's own
        lines.append(f"tokenizer: {found.tokenizer.uri} (tokenizer job {found.tokenizer.tokenizer_job})"
                     if found.tokenizer.uri else "tokenizer: the lineage's tokenizer job has not completed yet")
    return lines


def cmd_attribution(args: argparse.Namespace) -> int:
    report = client.attribution(client.stack_outputs(args.stack), args.model)
    if args.json:
        print(report.model_dump_json(indent=1))
        return 0
    table = Table(title=f"{args.model}: attribution (training job {report.job})")
    for column in ("partner", "license", "samples", "share", "draws", "share of draws"):
        table.add_column(column)
    for share in report.shares:
        table.add_row(share.partner, share.license, str(share.samples), f"{share.sample_share:.1%}",
                      "?" if share.draws is None else str(share.draws),
                      "?" if share.draw_share is None else f"{share.draw_share:.1%}")
    console.print(table)
    console.print(f"chart: {report.lineage_uri.removesuffix(s3_layout.LINEAGE_FILE)}{s3_layout.ATTRIBUTION_CHART}")
    return 0


def cmd_takedown(args: argparse.Namespace) -> int:
    revocation, affected, models = client.takedown(client.stack_outputs(args.stack), args.partner, args.license,
                                                   args.sha256, args.reason)
    if args.json:
        print(json.dumps({"revocation": revocation.model_dump(), "affected": [a.model_dump() for a in affected],
                          "models": models}, indent=1))
        return 0
    scope = f"{args.partner}" + (f", license {args.license}" if args.license else "") + (
        f", {len(args.sha256)} samples" if args.sha256 else ", every sample")
    console.print(f"takedown recorded ({scope}): no later manifest includes what it covers")
    if not affected:
        console.print("no training job learned from it")
        return 0
    table = Table(title="trained (or queued) before the takedown")
    for column in ("training job", "status", "stage", "covered samples", "SageMaker models"):
        table.add_column(column)
    for job in affected:
        table.add_row(job.job, job.status, str(job.stage), str(job.samples), ", ".join(models.get(job.job, [])) or "-")
    console.print(table)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    lineage = commands.add_parser(
        "lineage", help="what a model learned from: jobs, manifests, shards, samples; `lineage resume NAME` "
                        "lifts the failure brake of a halted lineage")
    lineage.add_argument("model", help="an endpoint name, a SageMaker model name or a training job name; "
                                       "or `resume`")
    lineage.add_argument("name", nargs="?", help="with `resume`: the lineage (TrainingLineage) to resume")
    lineage.add_argument("--json", action="store_true", help="the whole lineage.json")
    lineage.set_defaults(func=cmd_lineage)

    attribution = commands.add_parser("attribution", help="a model's samples and draws per partner and license")
    attribution.add_argument("model", help="an endpoint name, a SageMaker model name or a training job name")
    attribution.add_argument("--json", action="store_true", help="the whole attribution report as JSON")
    attribution.set_defaults(func=cmd_attribution)

    takedown = commands.add_parser("takedown", help="revoke a partner's samples: left out of every later manifest")
    takedown.add_argument("--partner", required=True, help="the partner whose samples are revoked")
    takedown.add_argument("--license", default="", help="only samples under this license")
    takedown.add_argument("--sha256", nargs="+", default=[], help="only these samples (their sha256)")
    takedown.add_argument("--reason", required=True, help="recorded with the takedown and in every manifest after it")
    takedown.add_argument("--json", action="store_true", help="the takedown, affected jobs and models as JSON")
    takedown.set_defaults(func=cmd_takedown)
