"""`atelier` commands for partner reports and training reports."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from atelier import client, reports

console = Console()


def cmd_report(args: argparse.Namespace) -> int:
    outputs = client.stack_outputs(args.stack)
    if args.job:
        page = reports.job_report(outputs, args.job)
        if args.output is None:
            sys.stdout.buffer.write(page)
        else:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_bytes(page)
            Console(stderr=True).print(f"training report of {args.job} -> {args.output} (open it in a browser)")
        return 0
    report = reports.partner_report(outputs, args.partner)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    origins = report["by_origin"]
    console.print(f"[bold]{escape(report['partner'])}[/]: {report['uploads']} uploaded "
                  f"({origins['upload']['accepted']} accepted), {report['imported']} imported "
                  f"({origins['import']['accepted']} accepted); {report['packed']} in shards; rejected: "
                  + (", ".join(f"{k} {v}" for k, v in sorted(report["rejected"].items())) or "none"))
    table = Table(title=f"Samples of {escape(report['partner'])}")
    for column in ("key", "origin", "status", "reason", "shard", "jobs", "models"):
        table.add_column(column)
    for item in report["items"]:
        table.add_row(escape(item["key"]), item["origin"], item["status"], escape(item["reason"] or ""),
                      (item["shard"] or "")[:16], ", ".join(item["jobs"]), ", ".join(item["models"]))
    console.print(table)
    for job in report["jobs"]:
        console.print(f"job {job['job']}: {job['status']}" + (f" -> model {job['model']}" if job["model"] else ""))
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    folder = args.dir or Path("tensorboard") / args.job
    uri, count = reports.fetch_tensorboard(client.stack_outputs(args.stack), args.job, folder)
    console.print(f"{count} TensorBoard file(s) of {args.job} from {uri} -> {folder}")
    console.print(f"open them with: tensorboard --logdir {folder}")
    if not args.local:
        console.print(f"or point SageMaker's TensorBoard app (or tensorboard --logdir) at {uri}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    report = commands.add_parser("report", help="a partner's uploads and where they went, or a training job's report")
    which = report.add_mutually_exclusive_group(required=True)
    which.add_argument("--partner", help="uploads, accepted, rejected (why), shards, training jobs and models")
    which.add_argument("--job", help="the training job's HTML report (loss, throughput, validation grids, gate)")
    report.add_argument("--json", action="store_true", help="with --partner: the report as JSON")
    report.add_argument("-o", "--output", type=Path, help="with --job: the file to write (default stdout)")
    report.set_defaults(func=cmd_report)

    board = commands.add_parser("tensorboard", help="fetch a training job's TensorBoard logs and print the dir to open")
    board.add_argument("job", help="the training job's name (`atelier status` lists them)")
    board.add_argument("--dir", type=Path, default=None, help="where the event files go (default ./tensorboard/<job>)")
    board.set_defaults(func=cmd_tensorboard)
