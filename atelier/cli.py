"""The `atelier` command. It talks to AWS APIs only, so the same commands work on real AWS
(after `sam deploy`) and on the local stack (`atelier local up`, then `--local` or
`eval "$(atelier local env)"`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from atelier import client

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STATE = REPO / ".atelier" / "local"
console = Console()
errors = Console(stderr=True)


# --- local stack ----------------------------------------------------------------------------------

def cmd_local_up(args: argparse.Namespace) -> int:
    from atelier.local.stack import LocalStack, StackOptions
    options = StackOptions(root=REPO, state_dir=args.state_dir, moto_port=args.port,
                           sagemaker_port=args.port + 1 if args.port else 0)
    with LocalStack(options) as stack:
        console.print(f"[bold green]local stack up[/]: {len(stack.outputs)} outputs, "
                      f"{len(stack.workers)} function workers; logs in {args.state_dir / 'logs'}")
        console.print("Point boto3 and atelier at it:\n  eval \"$(atelier local env)\"   (or pass --local)")
        console.print("Invoke one function in Docker with SAM (samconfig.toml [local] and events/env.json):\n"
                      "  sam build && sam local invoke --config-env local IngestFunction -e events/ingest_s3_put.json")
        if args.port != 5100:
            console.print("  (events/env.json and samconfig.toml name port 5100: edit them for another port)")
        console.print("Ctrl-C stops it.")
        try:
            while True:
                stack.check()
                time.sleep(2)
        except KeyboardInterrupt:
            console.print("stopping")
    return 0


def cmd_local_env(args: argparse.Namespace) -> int:
    from atelier.local.stack import read_env
    for key, value in sorted(read_env(args.state_dir).items()):
        print(f"export {key}={value}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from atelier.demo import DemoFailed, DemoOptions, run_demo
    try:
        result = run_demo(DemoOptions(root=REPO, state_dir=args.state_dir, output=args.output,
                                      images=args.images, stage_timeout_s=args.stage_timeout, keep_running=args.keep))
    except DemoFailed as exc:
        errors.print(f"[bold red]demo failed[/]: {exc}")
        return 1
    print(json.dumps(result))
    return 0


# --- pipeline -----------------------------------------------------------------------------------

def cmd_upload(args: argparse.Namespace) -> int:
    bucket = client.stack_outputs(args.stack)["UploadsBucketName"]
    count = 0
    for key in client.upload(args.path, args.partner, bucket):
        count += 1
        errors.print(f"uploaded s3://{bucket}/{key}")
    console.print(f"{count} objects uploaded for partner {args.partner}")
    return 0


def cmd_partner_add(args: argparse.Namespace) -> int:
    partner = client.add_partner(client.stack_outputs(args.stack), args.partner_id, args.license, args.prefix, args.terms)
    console.print(f"partner {partner.partner_id}: licenses {', '.join(partner.licenses)}; "
                  f"prefixes {', '.join(p or '(all)' for p in partner.prefixes)}")
    return 0


def cmd_partner_list(args: argparse.Namespace) -> int:
    found = client.partners(client.stack_outputs(args.stack))
    if args.json:
        print(json.dumps([p.model_dump() for p in found], indent=1))
        return 0
    table = Table(title="Partners")
    for column in ("partner", "licenses", "prefixes", "terms", "added"):
        table.add_column(column)
    for p in found:
        table.add_row(p.partner_id, ", ".join(p.licenses), ", ".join(x or "(all)" for x in p.prefixes), p.terms, p.added_at)
    console.print(table)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    outputs = client.stack_outputs(args.stack)
    while True:
        status = client.pipeline_status(outputs)
        if args.json:
            print(json.dumps(status.to_json(), indent=1))
            return 0
        console.clear() if args.watch else None
        console.print(status_table(status))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def status_table(status: client.Status) -> Table:
    table = Table(title="Atelier pipeline", show_lines=False)
    table.add_column("stage")
    table.add_column("state")
    table.add_row("uploads", ", ".join(f"{k} {v}" for k, v in sorted(status.uploads.items())) or "none")
    table.add_row("quarantined", ", ".join(f"{k} {v}" for k, v in sorted(status.quarantined.items())) or "none")
    table.add_row("samples", f"{status.samples} ({status.packed} packed)")
    table.add_row("shards", ", ".join(f"{k} {v}" for k, v in sorted(status.shards.items())) or "none")
    for job in status.jobs:
        table.add_row("training job", f"{job['name']}: {job['status']} ({job['shards']} shards)"
                      + (f" - {job['failure']}" if job.get("failure") else ""))
    for endpoint in status.endpoints or [{"name": "-", "status": "none", "config": None}]:
        table.add_row("endpoint", f"{endpoint['name']}: {endpoint['status']} ({endpoint.get('config') or '-'})")
    return table


def cmd_generate(args: argparse.Namespace) -> int:
    endpoint = args.endpoint or client.stack_outputs(args.stack)["EndpointName"]
    image = client.generate(endpoint, args.prompt, seed=args.seed, steps=args.steps)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(image)
    console.print(f"{args.prompt!r} -> {args.output} ({len(image)} bytes)")
    return 0


# --- parsing ------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="atelier", description=__doc__.split("\n\n")[0])
    top.add_argument("--stack", default=os.environ.get("ATELIER_STACK", "atelier"), help="CloudFormation stack name")
    top.add_argument("--local", action="store_true", help="use the running local stack (atelier local up)")
    top.add_argument("--state-dir", type=Path, default=DEFAULT_STATE, help="local stack state folder")
    commands = top.add_subparsers(dest="command", required=True)

    local = commands.add_parser("local", help="the embedded local stack").add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start moto, the template's resources, the functions and a local SageMaker")
    up.add_argument("--port", type=int, default=5100, help="moto's port (SageMaker's is the next one; 0: any free)")
    up.set_defaults(func=cmd_local_up)
    local.add_parser("env", help="print the exports that point boto3 at the running local stack").set_defaults(
        func=cmd_local_env)

    demo = commands.add_parser("demo", help="upload -> shards -> training -> endpoint -> image, on the local stack")
    demo.add_argument("--images", type=int, default=16)
    demo.add_argument("--output", type=Path, default=REPO / "demo-output" / "image.png")
    demo.add_argument("--stage-timeout", type=float, default=600.0, help="seconds a stage may take")
    demo.add_argument("--keep", action="store_true", help="keep the stack running afterwards")
    demo.set_defaults(func=cmd_demo, state_dir=REPO / ".atelier" / "demo")

    upload = commands.add_parser("upload", help="upload an image or a folder (sidecar .json files first)")
    upload.add_argument("path", type=Path)
    upload.add_argument("--partner", required=True)
    upload.set_defaults(func=cmd_upload)

    partner = commands.add_parser("partner", help="the partner registry: who licenses what").add_subparsers(
        dest="partner_command", required=True)
    add = partner.add_parser("add", help="register a partner and the licenses it grants (replaces an existing one)")
    add.add_argument("partner_id")
    add.add_argument("--license", action="append", required=True, help="a license id; repeat for several")
    add.add_argument("--prefix", action="append", default=[], help="key prefix under <partner>/ it may upload to")
    add.add_argument("--terms", default="", help="free text: contract reference, expiry, ...")
    add.set_defaults(func=cmd_partner_add)
    listing = partner.add_parser("list", help="the registered partners")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_partner_list)

    status = commands.add_parser("status", help="uploads, rejects, shards, training jobs and endpoints")
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, help="refresh every N seconds")
    status.set_defaults(func=cmd_status)

    generate = commands.add_parser("generate", help="draw an image with the deployed endpoint")
    generate.add_argument("prompt")
    generate.add_argument("-o", "--output", type=Path, required=True)
    generate.add_argument("--endpoint")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--steps", type=int, default=20)
    generate.set_defaults(func=cmd_generate)
    return top


def main(argv: list[str] | None = None) -> int:
    from atelier.local.stack import StackError, read_env
    args = parser().parse_args(argv)
    try:
        if args.local:
            os.environ.update(read_env(args.state_dir))
        return args.func(args)
    except (client.PipelineError, StackError) as exc:
        errors.print(f"[bold red]error[/]: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
