"""`atelier` commands for importing existing WebDataset shards (img2dataset output, any webdataset
tars): one ImportQueue message per tar, ImportFunction does the work (docs/import.md)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import boto3
from botocore.exceptions import ClientError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from atelier import client
from atelier.progress import output_flags
from contracts import pipeline_table, s3_layout
from contracts.messages import DEFAULT_NEAR_DUPLICATES, ImportShard, NearDuplicates
from core import aws
from core.ingest.uploads import PARTNER_PATTERN

if TYPE_CHECKING:  # core.import_shard needs the functions extra (Powertools, Pillow): imported when used
    from core.import_shard import records

console = Console()
errors = Console(stderr=True)
STAGING_PREFIX = s3_layout.IMPORTS
SIDECAR_SUFFIXES = (".parquet", "_stats.json")  # img2dataset's, staged beside their tar


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    run = commands.add_parser("import", help="import existing WebDataset shards (an s3:// prefix or a local folder)",
                              parents=[output_flags()])
    run.add_argument("source", help="s3://bucket/prefix/ or a folder of .tar shards (img2dataset output or any webdataset)")
    run.add_argument("--partner", required=True, help="the registered partner the images are licensed from")
    run.add_argument("--license", required=True, help="the license (one the partner holds) every sample is used under")
    run.add_argument("--batch", help="batch id; default: derived from source, partner and license, so a rerun resumes")
    run.add_argument("--near-duplicates", choices=get_args(NearDuplicates), default=DEFAULT_NEAR_DUPLICATES,
                     help="a sample near one already in the pipeline (same picture re-encoded or rescaled, same "
                          "colours): drop leaves it out, flag accepts it marked near_duplicate_of, keep accepts it "
                          f"unchecked (default {DEFAULT_NEAR_DUPLICATES})")
    run.add_argument("--wait", action="store_true", help="follow progress until every shard is done, then report")
    run.set_defaults(func=cmd_import)

    report = commands.add_parser("import-report", help="an import batch's progress and report",
                                 parents=[output_flags()])
    report.add_argument("batch", help="the batch id `atelier import` printed (imp-...)")
    report.add_argument("--wait", action="store_true", help="follow progress until every shard is done")
    report.set_defaults(func=cmd_import_report)


# --- commands -----------------------------------------------------------------------------------

def cmd_import(args: argparse.Namespace) -> int:
    from core.import_shard import records
    outputs = client.stack_outputs(args.stack)
    table = outputs["PipelineTableName"]
    check_license(table, args.partner, args.license)
    batch_id = args.batch or default_batch_id(args.source, args.partner, args.license, args.near_duplicates)
    earlier = records.batch_report(table, batch_id)
    if earlier is not None and earlier.near_duplicates != args.near_duplicates:
        raise client.PipelineError(f"batch {batch_id} imports with --near-duplicates {earlier.near_duplicates}: "
                                   "give that, or another --batch")
    sources = list_sources(args.source, outputs, batch_id)
    if not sources:
        raise client.PipelineError(f"no .tar shards under {args.source}")
    done = {s.source for s in (earlier or records.BatchReport(batch_id=batch_id)).shards}
    start_batch(table, batch_id, args.partner, args.license, args.source, len(sources), args.near_duplicates)
    todo = [(bucket, key) for bucket, key in sources if f"s3://{bucket}/{key}" not in done]
    send_messages(outputs["ImportQueueUrl"], [ImportShard(
        batch_id=batch_id, bucket=bucket, key=key, partner=args.partner, license=args.license,
        near_duplicates=args.near_duplicates) for bucket, key in todo])
    errors.print(f"import {batch_id}: {len(sources)} shards, {len(todo)} queued ({len(sources) - len(todo)} done before)")
    return _show(outputs, batch_id, args)


def cmd_import_report(args: argparse.Namespace) -> int:
    return _show(client.stack_outputs(args.stack), args.batch, args)


def _show(outputs: dict[str, str], batch_id: str, args: argparse.Namespace) -> int:
    from core.import_shard import records
    report = (wait_for(outputs, batch_id, quiet=args.quiet or args.json) if args.wait
              else records.batch_report(outputs["PipelineTableName"], batch_id))
    if report is None:
        raise client.PipelineError(f"no import batch {batch_id!r}")
    if args.json:
        print(json.dumps(report_json(report), indent=1))
    else:
        console.print(report_table(report))
        if report.samples_near_duplicate:
            console.print(near_duplicate_table(report))
    return 0 if report.complete or not args.wait else 1


# --- what the commands do -------------------------------------------------------------------------

def check_license(table: str, partner_id: str, license_id: str) -> None:
    from core.partners import licensing
    if not PARTNER_PATTERN.fullmatch(partner_id):
        raise client.PipelineError(f"partner id {partner_id!r} must be lower-case letters, digits and '-' (at most 64)")
    partner = licensing.get_partner(table, partner_id)
    if partner is None:
        raise client.PipelineError(f"partner {partner_id!r} is not registered: `atelier partner add {partner_id} "
                                   f"--license {license_id}` first")
    if license_id not in partner.licenses:
        raise client.PipelineError(f"partner {partner_id!r} holds {list(partner.licenses)}, not {license_id!r}")


def default_batch_id(source: str, partner: str, license_id: str,
                     near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES) -> str:
    """Derived from what is imported and how: the same command resumes its batch, while another
    --near-duplicates starts a new one (which finds the samples already imported exact duplicates).
    The default mode adds nothing, so batches begun before the option keep their ids."""
    where = source if source.startswith("s3://") else str(Path(source).resolve())
    mode = "" if near_duplicates == DEFAULT_NEAR_DUPLICATES else f"|{near_duplicates}"
    return "imp-" + hashlib.sha256(f"{where}|{partner}|{license_id}{mode}".encode()).hexdigest()[:16]


def list_sources(source: str, outputs: dict[str, str], batch_id: str) -> list[tuple[str, str]]:
    """(bucket, key) of every tar to import; a local folder is staged under the data bucket first."""
    if source.startswith("s3://"):
        bucket, _, prefix = source.removeprefix("s3://").partition("/")
        pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        try:
            return [(bucket, o["Key"]) for page in pages for o in page.get("Contents", []) if o["Key"].endswith(".tar")]
        except ClientError as exc:
            if aws.error_code(exc) != "NoSuchBucket":
                raise
            raise client.PipelineError(f"there is no bucket {bucket!r} (from {source}): check the URI; "
                                       "`aws s3 ls` lists the buckets you can read") from exc
    folder = Path(source)
    if not folder.is_dir():
        raise client.PipelineError(f"{source} is neither s3://bucket/prefix nor a folder")
    bucket, s3 = outputs["DataBucketName"], boto3.client("s3")
    staged = []
    for tar in sorted(folder.rglob("*.tar")):
        key = f"{STAGING_PREFIX}{batch_id}/{tar.relative_to(folder).as_posix()}"
        for sidecar in (tar.with_suffix(".parquet"), tar.with_name(tar.stem + "_stats.json")):
            if sidecar.exists():
                s3.upload_file(str(sidecar), bucket, key.removesuffix(".tar") + sidecar.name.removeprefix(tar.stem))
        if aws.head_object(bucket, key) is None or aws.head_object(bucket, key)["ContentLength"] != tar.stat().st_size:
            s3.upload_file(str(tar), bucket, key)
        staged.append((bucket, key))
    return staged


def start_batch(table: str, batch_id: str, partner: str, license_id: str, source: str, total: int,
                near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES) -> None:
    """The batch record; a rerun keeps its counters and only updates the shard count."""
    from core.import_shard import records
    if not aws.put_item_if_absent(table, records.batch_item(batch_id, partner, license_id, source, total,
                                                            near_duplicates)):
        aws.update_item(table, pipeline_table.import_batch_pk(batch_id), "SET shards_total = :t", {":t": total})


def send_messages(queue_url: str, messages: list["ImportShard"]) -> None:
    sqs = boto3.client("sqs")
    for start in range(0, len(messages), 10):
        chunk = messages[start:start + 10]
        response = sqs.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(i), "MessageBody": m.model_dump_json()} for i, m in enumerate(chunk)])
        if response.get("Failed"):
            raise client.PipelineError(f"SQS refused {len(response['Failed'])} messages: {response['Failed'][0]}")


def wait_for(outputs: dict[str, str], batch_id: str, poll_s: float = 2.0,
             quiet: bool = False) -> "records.BatchReport | None":
    """Follow the batch until every shard is counted (or failed for good into ImportDLQ); `quiet`: no bar."""
    from core.import_shard import records
    table = outputs["PipelineTableName"]
    report = records.batch_report(table, batch_id, with_shards=False)
    if report is None:
        return None
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[samples]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    started, first = time.monotonic(), report.finished
    with Progress(*columns, console=errors, transient=False, disable=quiet) as progress:
        task = progress.add_task(f"import {batch_id}", total=report.shards_total, completed=report.finished,
                                 samples="", rate="")
        while True:
            failed = dead_letters(outputs)
            elapsed = max(time.monotonic() - started, 1e-6)
            progress.update(task, total=report.shards_total, completed=report.finished,
                            samples=f"{report.samples_accepted} accepted, {report.samples_duplicate} duplicate, "
                                    f"{report.samples_near_duplicate} near duplicate, {report.samples_rejected} rejected",
                            rate=f"{(report.finished - first) / elapsed:.2f} shards/s" + (
                                f", {failed} in the DLQ" if failed else ""))
            if report.complete or report.finished + failed >= report.shards_total:
                break
            time.sleep(poll_s)
            report = records.batch_report(table, batch_id, with_shards=False) or report
    return records.batch_report(table, batch_id)


def dead_letters(outputs: dict[str, str]) -> int:
    if not outputs.get("ImportDLQUrl"):
        return 0
    attributes = boto3.client("sqs").get_queue_attributes(QueueUrl=outputs["ImportDLQUrl"],
                                                          AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


def report_json(report: "records.BatchReport") -> dict:
    value = report.model_dump(mode="json")
    value["shards"] = [s.model_dump(mode="json") for s in report.shards]
    value["complete"] = report.complete
    return value


def report_table(report: "records.BatchReport") -> Table:
    table = Table(title=f"Import {report.batch_id} ({report.partner}, {report.license})")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("shards", f"{report.finished} of {report.shards_total} ({report.shards_rejected} rejected whole)")
    for reason, count in sorted(report.shard_reasons.items()):
        table.add_row(f"  shards rejected: {reason}", str(count))
    table.add_row("samples read", str(report.samples_read))
    table.add_row("accepted", str(report.samples_accepted))
    table.add_row("  without a caption (flagged)", str(report.captions_missing))
    table.add_row("  width/height not the decoded image's (flagged)", str(report.size_mismatches))
    if report.near_duplicates == "flag":
        table.add_row("  near duplicates (flagged)", str(report.samples_near_duplicate))
    table.add_row("duplicate (left out)", str(report.samples_duplicate))
    if report.near_duplicates == "drop":
        table.add_row("near duplicate (left out)", str(report.samples_near_duplicate))
    elif report.near_duplicates == "keep":
        table.add_row("near duplicate", "not looked for (--near-duplicates keep)")
    table.add_row("rejected", str(report.samples_rejected))
    for reason, count in sorted(report.rejections.items()):
        table.add_row(f"  {reason}", str(count))
    truncated = sum(s.truncated for s in report.shards)
    if truncated:
        table.add_row("tars cut short (kept what came before)", str(truncated))
    return table


def near_duplicate_table(report: "records.BatchReport") -> Table:
    """Which samples were near duplicates, and of what (each tar's report names its first
    core.pack.records.LISTED_NEAR_DUPLICATES; the UPLOAD# and SAMPLE# records name them all)."""
    listed = [(shard.source.rsplit("/", 1)[-1], near) for shard in report.shards for near in shard.near_duplicate_samples]
    verb = "flagged" if report.near_duplicates == "flag" else "left out"
    table = Table(title=f"Near duplicates, {verb} ({len(listed)} of {report.samples_near_duplicate} listed)")
    for column, justify in (("sample", "left"), ("sha256", "left"), ("near", "left"), ("bits", "right"),
                            ("colour", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for tar, near in listed:
        table.add_row(f"{tar}#{near.key}", near.sha256[:12], near.of[:12], str(near.distance),
                      "-" if near.colour_distance is None else str(near.colour_distance))
    return table
