"""`atelier` commands for audit and dead-letter queues (docs/reliability.md)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timedelta, timezone

from rich.console import Console
from rich.table import Table

from atelier import client, dlq
from atelier.progress import output_flags, progress

console = Console()
DEFAULT_WINDOW = timedelta(days=1)


def _when(text: str) -> datetime:
    """An ISO time; without a zone it is UTC."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def cmd_audit(args: argparse.Namespace) -> int:
    from atelier import audit
    outputs = client.stack_outputs(args.stack)
    until = args.until or datetime.now(timezone.utc)
    since = args.since or until - DEFAULT_WINDOW
    with progress(args.quiet or args.json) as bar:
        task = bar.add_task("auditing shards", total=None)
        report = audit.gather(audit.Targets(outputs["UploadsBucketName"], outputs["DataBucketName"],
                                            outputs["PipelineTableName"]),
                              since, until, args.grace, verify_bytes=not args.skip_bytes,
                              on_shard=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        print(audit.to_json(report))
    else:
        console.print(f"{report.uploads} uploads ({report.accepted} accepted, {report.quarantined} quarantined, "
                      f"{len(report.pending)} pending), {report.shards} shards ({report.shards_verified} re-hashed)")
        for item in report.pending:
            console.print(f"  pending  {item.stage:<10} {item.age_s:>8.0f} s  {item.key}")
        for violation in report.violations:
            console.print(f"  [bold red]{violation.kind}[/] {violation.subject}: {violation.detail}")
        console.print("[bold green]ok[/]" if report.ok else f"[bold red]{len(report.violations)} violations[/]")
    return 0 if report.ok else 1


def cmd_dlq_list(args: argparse.Namespace) -> int:
    found = [dlq.describe(name, url) for name, url in dlq.queues(client.stack_outputs(args.stack)).items()]
    if args.json:
        print(json.dumps([{"name": d.name, "url": d.url, "messages": d.messages, "hidden": d.hidden,
                           "sources": list(d.sources)} for d in found], indent=1))
        return 0
    table = Table(title="Dead-letter queues")
    for column in ("queue", "messages", "hidden", "redrives to"):
        table.add_column(column)
    for d in found:
        table.add_row(d.name, str(d.messages), str(d.hidden), ", ".join(u.rsplit("/", 1)[-1] for u in d.sources) or "EventBridge")
    console.print(table)
    return 0


def cmd_dlq_show(args: argparse.Namespace) -> int:
    dead = dlq.lookup(client.stack_outputs(args.stack), args.queue)
    messages = dlq.peek(dead, args.max)
    if args.json:
        print(json.dumps(messages, indent=1))
        return 0
    for m in messages:
        sent = datetime.fromtimestamp(m["sent_at"] / 1000, timezone.utc).isoformat(timespec="seconds")
        console.print(f"[bold]{m['id']}[/] sent {sent}, received {m['receives']} times {m['attributes'] or ''}")
        console.print(m["body"] if args.full else m["body"][:400])
    hidden = f"; {dead.hidden} more hidden (waiting out a backoff, or being read by the redriver)" if dead.hidden else ""
    console.print(f"{len(messages)} messages shown{hidden}; nothing removed")
    return 0


def cmd_dlq_redrive(args: argparse.Namespace) -> int:
    dead = dlq.lookup(client.stack_outputs(args.stack), args.queue)
    done = dlq.redrive(dead, args.max, args.method)
    console.print(f"{dead.name}: {done.moved} messages replayed ({done.method})"
                  + (f", task {done.task}" if done.task else "") + (f"; {done.kept} kept" if done.kept else ""))
    return 1 if done.kept else 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    audit = commands.add_parser("audit", help="check that every upload is in exactly one intact shard or quarantined",
                                parents=[output_flags()])
    audit.add_argument("--since", type=_when, help="ISO time; default a day before --until")
    audit.add_argument("--until", type=_when, help="ISO time; default now")
    audit.add_argument("--grace", type=float, default=7200.0,
                       help="seconds an upload may still be on its way (default 7200: SHARD_MAX_AGE_S + margin)")
    audit.add_argument("--skip-bytes", action="store_true", help="check the indexes only, not the shards' bytes")
    audit.set_defaults(func=cmd_audit)

    queues = commands.add_parser("dlq", help="inspect and replay dead letters").add_subparsers(
        dest="dlq_command", required=True)
    listing = queues.add_parser("list", help="every dead-letter queue of the stack and what it holds")
    listing.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    listing.set_defaults(func=cmd_dlq_list)
    show = queues.add_parser("show", help="print messages of one DLQ (they stay there)")
    show.add_argument("queue", help="e.g. UploadsDLQ (see `atelier dlq list`)")
    show.add_argument("--max", type=int, default=10, help="at most this many messages (default 10)")
    show.add_argument("--full", action="store_true", help="whole bodies, not their first 400 characters")
    show.add_argument("--json", action="store_true", help="the messages as a JSON list")
    show.set_defaults(func=cmd_dlq_show)
    redrive = queues.add_parser("redrive", help="replay a DLQ's messages to their source (queue or event bus)")
    redrive.add_argument("queue", help="e.g. UploadsDLQ (see `atelier dlq list`)")
    redrive.add_argument("--max", type=int, default=1000, help="at most this many (one-by-one and events)")
    redrive.add_argument("--method", choices=("auto", "move-task", "one-by-one"), default="auto",
                         help="auto: SQS StartMessageMoveTask where available, else one by one")
    redrive.set_defaults(func=cmd_dlq_redrive)
