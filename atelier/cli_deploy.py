"""`atelier` commands for models, the evaluation gate, rollback."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from atelier import client, operator_requests
from contracts import pipeline_table, s3_layout
from core import aws

console = Console()


def cmd_models(args: argparse.Namespace) -> int:
    found = client.models(client.stack_outputs(args.stack))
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    table = Table(title="Models (deploy candidates)")
    for column in ("model", "status", "decision", "val loss", "CLIP", "production (val loss, CLIP)", "reason"):
        table.add_column(column)
    for m in found:
        production = (f"{m['production_model']} ({_number(m['production_val_loss'])}, "
                      f"{_number(m['production_clip_score'], '{:.2f}')})" if m["production_model"] else "-")
        table.add_row(m["model"], m["status"], m["decision"] or "-", _number(m["val_loss"]),
                      _number(m["clip_score"], "{:.2f}"), production, m["reason"])
    console.print(table)
    return 0


def _number(value: float | None, form: str = "{:.4f}") -> str:
    return "-" if value is None else form.format(value)


def cmd_rollback(args: argparse.Namespace) -> int:
    with console.status("rollback requested; waiting for DeployFunction's answer") as status:
        result = operator_requests.rollback(client.stack_outputs(args.stack), args.to, args.reason, args.timeout,
                                 lambda waited: status.update(f"rollback requested; waiting for DeployFunction's "
                                                              f"answer ({waited:.0f} s)"))
    if args.json:
        print(json.dumps(result))
    else:
        console.print(f"[bold]rolled back[/]: {result['change']} (blue/green; `atelier status` shows the rollout)")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    outputs = client.stack_outputs(args.stack)
    result = operator_requests.evaluate(outputs, args.model)
    if args.wait:
        result["status"] = _wait_for_decision(outputs, args.model, result["attempt"], args.timeout)
    if args.json:
        print(json.dumps(result))
    elif args.wait:
        console.print(f"{args.model}: {result['status']['status']} ({result['status']['reason']})")
    else:
        console.print(f"evaluation of {args.model} requested (it was eval-failed: {result['previous_reason']}); "
                      "`atelier models` shows the gate's decision")
    return 0


def _wait_for_decision(outputs: dict, model: str, before: int, timeout_s: float) -> dict:
    """Poll the model's record until the request was taken (its attempt number rose) and the
    evaluation settled it: passed, deployed, held-back, superseded or eval-failed again."""
    table = outputs["PipelineTableName"]
    deadline = time.monotonic() + timeout_s
    while True:
        record = aws.get_item(table, pipeline_table.model_pk(model)) or {}
        if int(record.get("eval_attempt", 0)) > before and record.get("status") != "evaluating":
            return {"status": record.get("status"), "reason": record.get("reason", "")}
        if time.monotonic() > deadline:
            raise client.PipelineError(f"{model} is still {record.get('status')} after {timeout_s:.0f} s")
        time.sleep(2)


def cmd_evalset_add(args: argparse.Namespace) -> int:
    from atelier import evalset
    from core.partners.licensing import get_partner
    outputs = client.stack_outputs(args.stack)
    partner = get_partner(outputs["PipelineTableName"], args.partner)
    if partner is None:
        raise client.PipelineError(f"partner {args.partner!r} is not registered: `atelier partner add` first")
    try:
        samples = evalset.samples_from_folder(args.folder, args.partner, partner.licenses)
    except evalset.EvalSetError as exc:
        raise client.PipelineError(str(exc)) from exc
    uri = evalset.upload(samples, outputs["DataBucketName"], args.prefix, args.name)
    console.print(f"{len(samples)} held-out samples -> {uri}; every later candidate is scored on them")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    models = commands.add_parser("models", help="deploy candidates: evaluation scores, the gate's decision, rollout")
    models.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    models.set_defaults(func=cmd_models)

    rollback = commands.add_parser("rollback", help="serve the previous model again (blue/green)")
    rollback.add_argument("--to", help="a model that served before (default: the one before the current)")
    rollback.add_argument("--reason", default="rolled back by an operator", help="recorded with the rolled-back model")
    rollback.add_argument("--timeout", type=float, default=120, help="seconds to wait for DeployFunction's answer")
    rollback.add_argument("--json", action="store_true", help="the outcome as one JSON object")
    rollback.set_defaults(func=cmd_rollback)

    evaluate = commands.add_parser("evaluate", help="evaluate an eval-failed model again (after `atelier evalset add`)")
    evaluate.add_argument("model", help="a model name from `atelier models`")
    evaluate.add_argument("--wait", action="store_true", help="until the gate decides")
    evaluate.add_argument("--timeout", type=float, default=3600, help="seconds --wait waits")
    evaluate.add_argument("--json", action="store_true", help="the outcome as one JSON object")
    evaluate.set_defaults(func=cmd_evaluate)

    evalset = commands.add_parser("evalset", help="the held-out evaluation set the deploy gate scores on").add_subparsers(
        dest="evalset_command", required=True)
    add = evalset.add_parser("add", help="add a folder of images with .json sidecars (caption, license) as one tar")
    add.add_argument("folder", type=Path, help="images with .json sidecars (caption, license), as `upload` takes them")
    add.add_argument("--partner", required=True, help="whose licensed images these are")
    add.add_argument("--name", default="heldout", help="the tar's name under the prefix")
    add.add_argument("--prefix", default=s3_layout.EVAL, help="the template's EvalDataPrefix")
    add.set_defaults(func=cmd_evalset_add)
