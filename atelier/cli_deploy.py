"""`atelier` commands for models, the evaluation gate, rollback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from atelier import client

console = Console()


def cmd_models(args: argparse.Namespace) -> int:
    found = client.models(client.stack_outputs(args.stack))
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    table = Table(title="Models (deploy candidates)")
    for column in ("model", "status", "val loss", "production", "CLIP", "reason"):
        table.add_column(column)
    for m in found:
        table.add_row(m["model"], m["status"], _number(m["val_loss"]),
                      f"{_number(m['production_val_loss'])} ({m['production_model']})" if m["production_model"] else "-",
                      _number(m["clip_score"], "{:.2f}"), m["reason"])
    console.print(table)
    return 0


def _number(value: float | None, form: str = "{:.4f}") -> str:
    return "-" if value is None else form.format(value)


def cmd_rollback(args: argparse.Namespace) -> int:
    result = client.rollback(client.stack_outputs(args.stack), args.to, args.reason)
    if args.json:
        print(json.dumps(result))
    else:
        console.print(f"[bold]rolled back[/]: {result['change']} (blue/green; `atelier status` shows the rollout)")
    return 0


def cmd_evalset_add(args: argparse.Namespace) -> int:
    from atelier import evalset
    outputs = client.stack_outputs(args.stack)
    try:
        samples = evalset.samples_from_folder(args.folder, args.partner)
    except evalset.EvalSetError as exc:
        raise client.PipelineError(str(exc)) from exc
    uri = evalset.upload(samples, outputs["DataBucketName"], args.prefix, args.name)
    console.print(f"{len(samples)} held-out samples -> {uri}; every later candidate is scored on them")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    models = commands.add_parser("models", help="deploy candidates: evaluation scores, the gate's decision, rollout")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_models)

    rollback = commands.add_parser("rollback", help="serve the previous model again (blue/green)")
    rollback.add_argument("--to", help="a model that served before (default: the one before the current)")
    rollback.add_argument("--reason", default="rolled back by an operator", help="recorded with the rolled-back model")
    rollback.add_argument("--json", action="store_true")
    rollback.set_defaults(func=cmd_rollback)

    evalset = commands.add_parser("evalset", help="the held-out evaluation set the deploy gate scores on").add_subparsers(
        dest="evalset_command", required=True)
    add = evalset.add_parser("add", help="add a folder of images with .json sidecars (caption, license) as one tar")
    add.add_argument("folder", type=Path)
    add.add_argument("--partner", required=True, help="whose licensed images these are")
    add.add_argument("--name", default="heldout", help="the tar's name under the prefix")
    add.add_argument("--prefix", default="eval/", help="the template's EvalDataPrefix")
    add.set_defaults(func=cmd_evalset_add)
