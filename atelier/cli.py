"""The `atelier` command. It talks to AWS APIs only, so the same commands work on real AWS
(after `sam deploy`) and on the local stack (`atelier local up`, then `--local` or
`eval "$(atelier local env)"`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from atelier import client, failures, partners
from atelier.progress import output_flags, progress

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STATE = REPO / ".atelier" / "local"
DEMO_STATE = REPO / ".atelier" / "demo"  # `atelier demo`'s own stack, apart from `local up`'s
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
console = Console()
errors = Console(stderr=True)
# atelier/<area>.py modules with a `register(commands)` that adds their subcommands
COMMAND_AREAS = ("cli_base", "cli_deploy", "cli_import", "cli_partner", "cli_provenance", "cli_recipe",
                 "cli_reliability", "cli_report")


# --- local stack ----------------------------------------------------------------------------------

def _checkout() -> None:
    """The local stack runs the checkout's template.yaml, functions/ and trainer/, which a wheel does not hold."""
    if not (REPO / "template.yaml").exists():
        raise client.PipelineError("the local stack and the demo run from a checkout of the repository: clone it, "
                                   "then `make local` or `make demo` there")


def cmd_local_up(args: argparse.Namespace) -> int:
    _checkout()
    from atelier import bases
    from atelier.local import signing
    from atelier.local.stack import LocalStack, StackOptions
    if args.base is not None:
        bases.check(args.base, args.base.resolve().name)  # a bad folder fails before anything starts
    options = StackOptions(root=REPO, state_dir=args.state_dir, moto_port=args.port,
                           sagemaker_port=args.port + 1 if args.port else 0, overrides=dict(args.parameter),
                           base=args.base, enforce_iam=args.enforce_iam, sign_images=args.sign)
    try:
        with stopped_by_signals(), LocalStack(options) as stack:
            for line in local_up_banner(len(stack.outputs), len(stack.workers), args.state_dir / "logs", args.port,
                                        args.enforce_iam, args.state_dir / signing.ROOT_FILE if args.sign else None):
                console.print(line, soft_wrap=True)  # the terminal wraps: commands stay one line to copy
            while True:
                stack.check()
                time.sleep(2)
    except KeyboardInterrupt:  # Ctrl-C or a stop signal, also while starting: every process it started has ended
        console.print("local stack stopped")
    return 0


def local_up_banner(outputs: int, workers: int, logs: Path, port: int, enforce_iam: bool = False,
                    signing_root: Path | None = None) -> list[str]:
    """What `local up` prints once the stack is up, as rich markup: text in brackets that is not
    markup (`[local]`) is escaped, or rich would drop it."""
    lines = [f"[bold green]local stack up[/]: {outputs} outputs, {workers} function workers; logs in {escape(str(logs))}",
             "Point boto3 and atelier at it:\n  eval \"$(atelier local env)\"   (or pass --local)",
             escape("Invoke one function in Docker with SAM (samconfig.toml [local] and events/env.json):\n"
                    "  sam build && sam local invoke --config-env local IngestFunction -e events/ingest_s3_put.json")]
    if port != 5100:
        lines.append("  (events/env.json and samconfig.toml name port 5100: edit them for another port)")
    if enforce_iam:
        lines.append("IAM is enforced: `atelier local env` holds the administrator's keys; partners upload with their own "
                     "(docs/local.md, partner profiles)")
    if signing_root is not None:
        lines.append(f"Served PNGs are signed (C2PA) by a local CA: verify them with {escape(str(signing_root))} as the "
                     "trust anchor (docs/provenance.md)")
    return [*lines, "Ctrl-C stops it."]


class Stopped(KeyboardInterrupt):
    """A stop signal arrived: the stack of this process stops as on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP (the terminal closed) raise Stopped, so a `with LocalStack` stops
    every process it started; also when started as a background job of a non-interactive shell,
    which inherits SIGINT ignored. Once one arrived the others are ignored, so the stop runs to its
    end. The handlers before are restored after."""
    def stop(signum: int, frame: Any) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise Stopped(signum)
    previous = {each: signal.getsignal(each) for each in STOP_SIGNALS}
    for each in STOP_SIGNALS:
        signal.signal(each, stop)
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def local_env(state_dir: Path) -> dict[str, str]:
    """The running local stack's environment; where the default folder has none but a demo's stack
    does, the error names the flag that reaches the demo's."""
    from atelier.local.state import StackError, read_env
    try:
        return read_env(state_dir)
    except StackError as exc:
        if state_dir == DEFAULT_STATE and (DEMO_STATE / "stack.json").exists():
            raise StackError(f"{exc}, or reach the stack of `atelier demo --keep` with "
                             f"`--state-dir {DEMO_STATE}`") from exc
        raise


def cmd_local_env(args: argparse.Namespace) -> int:
    for key, value in sorted(local_env(args.state_dir).items()):
        print(f"export {key}={value}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _checkout()
    from atelier.demo import DemoFailed, DemoOptions, run_demo
    try:
        with stopped_by_signals():
            result = run_demo(DemoOptions(root=REPO, state_dir=args.state_dir, output=args.output,
                                          images=args.images, keep_running=args.keep, grid=args.grid,
                                          **({"stage_timeout_s": args.stage_timeout} if args.stage_timeout else {}),
                                          quiet=args.quiet or args.json))
    except DemoFailed as exc:
        errors.print(f"[bold red]demo failed[/]: {exc}")
        return 1
    except Stopped as stopped:  # the stack is stopped: every process it started has ended
        errors.print(f"[bold red]demo stopped[/] by {stopped}: its local stack is stopped")
        return 128 + stopped.signum
    for line in result:  # with or without --json: one JSON line per figure, as bench/ prints them
        print(json.dumps(line))
    return 0


# --- pipeline -----------------------------------------------------------------------------------

def cmd_upload(args: argparse.Namespace) -> int:
    if args.profile is not None:
        return _upload_as_partner(args)
    if args.partner is None:
        raise client.PipelineError("name the partner (--partner ID), or upload with its profile (--profile partner.toml)")
    outputs = client.stack_outputs(args.stack)
    bucket = outputs["UploadsBucketName"]
    files = client.files_to_upload(args.path)
    unregistered = client.unregistered_partner(outputs, args.partner, len(files))
    if unregistered and not args.force:
        raise client.PipelineError(f"{unregistered}: register it with `atelier partner add {args.partner} --license "
                                   "LICENSE`, or pass --force to upload anyway")
    if unregistered:
        errors.print(f"[bold yellow]warning[/]: {escape(unregistered)} (uploading anyway: --force)", soft_wrap=True)
    return _send(args, files, args.partner, bucket, s3=None)


def _upload_as_partner(args: argparse.Namespace) -> int:
    """With the partner role alone: where to upload comes from the profile, not the stack or the table."""
    profile = partners.read_profile(args.profile)
    if args.partner not in (None, profile.partner):
        raise client.PipelineError(f"--partner {args.partner} is not {args.profile}'s partner ({profile.partner})")
    files = client.files_to_upload(args.path)
    return _send(args, files, profile.partner, profile.bucket, s3=partners.s3_client(profile))


def _send(args: argparse.Namespace, files: list[Path], partner: str, bucket: str, s3: Any) -> int:
    size, count, started = sum(f.stat().st_size for f in files), 0, time.monotonic()
    with progress(args.quiet or args.json, transfer=True) as bar:
        task = bar.add_task(f"{len(files)} files -> s3://{bucket}/{partner}/", total=size)
        for _ in client.upload(args.path, partner, bucket, on_bytes=lambda n: bar.advance(task, n), s3=s3):
            count += 1
    if args.json:
        print(json.dumps({"partner": partner, "destination": f"s3://{bucket}/{partner}/", "objects": count,
                          "bytes": size, "seconds": round(time.monotonic() - started, 3)}))
    else:
        console.print(f"{count} objects uploaded for partner {partner}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """One table (or JSON document); with --watch, again every N seconds until Ctrl-C (JSON: one line each)."""
    outputs = client.stack_outputs(args.stack)
    try:
        while True:
            status = client.pipeline_status(outputs)
            if args.json:
                print(json.dumps(status.to_json(), indent=None if args.watch else 1), flush=True)
            else:
                console.clear() if args.watch else None
                console.print(status_table(status))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def status_table(status: client.Status) -> Table:
    table = Table(title="Atelier pipeline", show_lines=False)
    table.add_column("stage")
    table.add_column("state")
    table.add_row("uploads", ", ".join(f"{k} {v}" for k, v in sorted(status.uploads.items())) or "none")
    table.add_row("quarantined", ", ".join(f"{k} {v}" for k, v in sorted(status.quarantined.items())) or "none")
    if status.imported or status.imports_quarantined:  # `atelier import`: not uploads, counted apart
        table.add_row("imports", f"{status.imported} samples; refused: "
                      + (", ".join(f"{k} {v}" for k, v in sorted(status.imports_quarantined.items())) or "none"))
    table.add_row("samples", f"{status.samples} ({status.packed} packed)")
    table.add_row("shards", ", ".join(f"{k} {v}" for k, v in sorted(status.shards.items())) or "none")
    for job in status.jobs:
        table.add_row(f"{job.get('role', 'train')} job", f"{job['name']}: {job['status']} ({job['shards']} shards)"
                      + (f" - {job['failure']}" if job.get("failure") else ""))
    for lineage in status.lineages:
        if lineage["held"]:  # halted or backing off: the reason a person should see first
            table.add_row("lineage", f"[bold red]{lineage['name']}: {escape(lineage['held'])}[/]"
                          + (f" - `atelier lineage resume {lineage['name']}`" if "halted" in lineage["held"] else ""))
    for model in status.models[-5:]:
        table.add_row("model", model_line(model))
    for endpoint in status.endpoints or [{"name": "-", "status": "none", "config": None}]:
        table.add_row("endpoint", f"{endpoint['name']}: {endpoint['status']} ({endpoint.get('config') or '-'})")
    return table


SCORES = (("val loss", "val_loss", ".4f"), ("CLIP", "clip_score", ".2f"))  # label, model_summary key, format


def model_line(model: dict) -> str:
    """One candidate: its state, the gate's decision, its scores against production's, and why."""
    decision = f"; gate {model['decision']}" if model.get("decision") else ""
    scores = "".join(f", {label} {model[key]:{form}}" + (f" vs {model['production_' + key]:{form}}"
                                                         if model.get("production_" + key) is not None else "")
                     for label, key, form in SCORES if model.get(key) is not None)
    versus = f" (production {model['production_model']})" if model.get("production_model") else ""
    return (f"{model['model']}: {model['status']}{decision}{scores}{versus}"
            + (f" - {model['reason']}" if model.get("reason") else ""))


def cmd_generate(args: argparse.Namespace) -> int:
    endpoint = args.endpoint or client.stack_outputs(args.stack)["EndpointName"]
    image = client.generate(endpoint, args.prompt, seed=args.seed, steps=args.steps, guidance=args.guidance)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(image)
    console.print(f"{args.prompt!r} -> {args.output} ({len(image)} bytes)")
    return 0


# --- parsing ------------------------------------------------------------------------------------

def parameter_override(text: str) -> tuple[str, str]:
    """NAME=VALUE, as `sam deploy --parameter-overrides` takes it."""
    name, equals, value = text.partition("=")
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (a template parameter and its value)")
    return name, value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="atelier", description=__doc__.split("\n\n")[0])
    top.add_argument("--stack", default=os.environ.get("ATELIER_STACK", "atelier"), help="CloudFormation stack name")
    top.add_argument("--local", action="store_true", help="use the running local stack (atelier local up)")
    top.add_argument("--state-dir", type=Path, default=None,
                     help="local stack state folder (default .atelier/local; the demo's: .atelier/demo)")
    top.add_argument("-q", "--quiet", action="store_true", help="no progress bars (they go to stderr)")
    top.set_defaults(json=False)  # a long command's --json (output_flags) sets it
    commands = top.add_subparsers(dest="command", required=True)

    local = commands.add_parser("local", help="the embedded local stack").add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start moto, the template's resources, the functions and a local SageMaker")
    up.add_argument("--port", type=int, default=5100, help="moto's port (SageMaker's is the next one; 0: any free)")
    up.add_argument("--parameter", action="append", type=parameter_override, default=[], metavar="NAME=VALUE",
                    help="a template parameter, over samconfig.toml [local]'s (repeat for several), "
                         "e.g. TrainingQuota=4 (what the jobs train is the recipe: recipes/local.toml, "
                         "`atelier recipe set`)")
    up.add_argument("--base", type=Path, default=None, metavar="DIR",
                    help="a diffusers pipeline folder (or some of its parts: vae/, text_encoder/, ...) every job "
                         "starts from: uploaded and set as PretrainedModelUri")
    up.add_argument("--enforce-iam", action="store_true",
                    help="moto checks every request against IAM, as AWS does (try partner profiles); the stack runs "
                         "as an administrator user")
    up.add_argument("--sign", action="store_true",
                    help="sign served PNGs with C2PA: a throwaway local CA's certificate in a Secrets Manager secret "
                         "(C2paSigningSecretArn); its root is written to the state folder")
    up.set_defaults(func=cmd_local_up)
    local.add_parser("env", help="print the exports that point boto3 at the running local stack").set_defaults(
        func=cmd_local_env)

    demo = commands.add_parser("demo", help="upload -> shards -> training -> endpoint -> image, on the local stack",
                               parents=[output_flags()])
    demo.add_argument("--images", type=int, default=252, help="training pictures of the procedural catalogue (three per combination)")
    demo.add_argument("--output", type=Path, default=REPO / "demo-output" / "image.png",
                      help="where the drawn PNG goes (default demo-output/image.png)")
    demo.add_argument("--stage-timeout", type=float, default=None,
                      help="seconds without progress (no status change, no new job log line) before the demo calls a stage stalled (default 900)")
    demo.add_argument("--keep", action="store_true", help="keep the stack running afterwards")
    demo.add_argument("--grid", action="store_true", help="also draw the whole catalogue grid, scored on colours and shape "
                      "(demo.prompt_match_grid: 180 pictures, a minute or two more)")
    demo.set_defaults(func=cmd_demo, default_state_dir=DEMO_STATE)

    upload = commands.add_parser("upload", help="upload an image or a folder (sidecar .json files first)",
                                 parents=[output_flags()])
    upload.add_argument("path", type=Path, help="an image (its .json sidecar goes with it) or a folder of them")
    upload.add_argument("--partner", help="the registered partner the images are licensed from; "
                        "they land under s3://<uploads bucket>/<partner>/")
    upload.add_argument("--profile", type=Path, help="a partner profile (`atelier partner export ID`): upload with the "
                        "partner's own rights alone (no stack or registry access)")
    upload.add_argument("--force", action="store_true",
                        help="upload even when the partner is not registered (every file is then quarantined as unlicensed)")
    upload.set_defaults(func=cmd_upload)

    status = commands.add_parser("status", help="uploads, rejects, shards, training jobs and endpoints")
    status.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0,
                        help="refresh every N seconds (default 2) until Ctrl-C; with --json one line per refresh")
    status.set_defaults(func=cmd_status)

    generate = commands.add_parser("generate", help="draw an image with the deployed endpoint")
    generate.add_argument("prompt", help="what to draw")
    generate.add_argument("-o", "--output", type=Path, required=True, help="where the PNG goes")
    generate.add_argument("--endpoint", help="endpoint name (default: the stack's)")
    generate.add_argument("--seed", type=int, default=0,
                          help="seed of the starting noise: the same prompt, seed and steps draw the same image (default 0)")
    generate.add_argument("--steps", type=int, default=20,
                          help="denoising steps: more is slower and finer (default 20)")
    generate.add_argument("--guidance", type=float, default=None,
                          help="classifier-free guidance scale (default: the server's, 5); the demo's model: 2")
    generate.set_defaults(func=cmd_generate)

    # Each area's commands live in their own module; each adds its subcommands here.
    for area in COMMAND_AREAS:
        importlib.import_module(f"atelier.{area}").register(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    from atelier.local.state import StackError
    from atelier.local.template import TemplateError
    args = parser().parse_args(argv)
    args.state_dir = args.state_dir or getattr(args, "default_state_dir", DEFAULT_STATE)
    try:
        if args.local:
            os.environ.update(local_env(args.state_dir))
        return args.func(args)
    except (client.PipelineError, StackError, TemplateError) as exc:
        return _fail(str(exc))
    except (BotoCoreError, ClientError) as exc:
        sentence = failures.explain(exc, args.local, args.state_dir)
        if sentence is None:  # not something the user can fix: the traceback is for us
            raise
        return _fail(sentence)


def _fail(sentence: str) -> int:
    errors.print(f"[bold red]error[/]: {escape(sentence)}", soft_wrap=True)  # one line, however long
    return 2


if __name__ == "__main__":
    sys.exit(main())
