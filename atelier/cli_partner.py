"""`atelier partner add | list | export`: the partner registry, each partner's upload role, and the
profile a partner uploads with (`atelier upload --profile`; docs/runbook.md, docs/reliability.md)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from atelier import client, partners

console = Console()


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    partner = commands.add_parser("partner", help="the partner registry: who licenses what").add_subparsers(
        dest="partner_command", required=True)
    add = partner.add_parser("add", help="register a partner and the licenses it grants (replaces an existing one)")
    add.add_argument("partner_id", help="lower-case letters, digits and '-': the prefix its uploads go under")
    add.add_argument("--license", action="append", required=True, help="a license id; repeat for several")
    add.add_argument("--prefix", action="append", default=[], help="key prefix under <partner>/ it may upload to")
    add.add_argument("--terms", default="", help="free text: contract reference, expiry, ...")
    add.add_argument("--not-after", default="", help="YYYY-MM-DD: no manifest built after this day trains on its samples")
    add.add_argument("--use", action="append", default=[], help="a use its licenses allow (e.g. research); repeat for "
                     "several; none: any use")
    add.add_argument("--principal", action="append", default=[], metavar="ARN",
                     help="an IAM role or user ARN that may assume the partner's upload role (made or updated now; "
                          "repeat for several); none: no role (an earlier one is removed)")
    add.set_defaults(func=cmd_partner_add)
    listing = partner.add_parser("list", help="the registered partners")
    listing.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    listing.set_defaults(func=cmd_partner_list)
    export = partner.add_parser("export", help="print the partner's profile (TOML) for `atelier upload --profile`")
    export.add_argument("partner_id", help="a partner registered with --principal")
    export.set_defaults(func=cmd_partner_export)


def cmd_partner_add(args: argparse.Namespace) -> int:
    outputs = client.stack_outputs(args.stack)
    role = partners.update_role(args.stack, outputs, args.partner_id, args.principal)  # before the entry naming it
    partner = client.add_partner(outputs, args.partner_id, args.license, args.prefix, args.terms,
                                 args.not_after, args.use, args.principal)
    console.print(f"partner {partner.partner_id}: licenses {', '.join(partner.licenses)}; "
                  f"prefixes {', '.join(p or '(all)' for p in partner.prefixes)}")
    if role:
        console.print(f"upload role {role}, assumable by {', '.join(partner.principals)}: give the partner "
                      f"`atelier partner export {partner.partner_id}`'s output", soft_wrap=True)
    return 0


def cmd_partner_list(args: argparse.Namespace) -> int:
    found = client.partners(client.stack_outputs(args.stack))
    if args.json:
        print(json.dumps([p.model_dump() for p in found], indent=1))
        return 0
    table = Table(title="Partners")
    for column in ("partner", "licenses", "prefixes", "terms", "added", "uploads as"):
        table.add_column(column)
    for p in found:
        table.add_row(p.partner_id, ", ".join(p.licenses), ", ".join(x or "(all)" for x in p.prefixes), p.terms,
                      p.added_at, ", ".join(p.principals) or "-")
    console.print(table)
    return 0


def cmd_partner_export(args: argparse.Namespace) -> int:
    sys.stdout.write(partners.export(args.stack, client.stack_outputs(args.stack), args.partner_id))
    return 0
