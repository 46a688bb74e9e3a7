"""Copies dashboard.json into template.yaml as PipelineDashboard's DashboardBody, between two markers.

CloudFormation takes a dashboard body only as a string in the template: AWS::Include reads from S3,
not from this checkout, so dashboard.json is what a person edits and template.yaml carries a copy.
`python tools/render_dashboard.py` rewrites the copy; `--check` exits 1 when the two differ
(tests/unit/test_render_dashboard.py fails then too). `${...}` in the file are Fn::Sub variables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEGIN = "      # BEGIN dashboard.json: tools/render_dashboard.py writes the DashboardBody below; edit that file"
END = "      # END dashboard.json"
BODY_INDENT = " " * 8  # the block scalar's, under PipelineDashboard's Properties
WIDTH = 120


def _flat(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _lines(value: Any, column: int, indent: int, width: int, tail: int = 0) -> list[str]:
    """JSON of value: one line from `column` where it fits, else its members packed onto lines of at most
    `width`, the later lines indented `indent + 2`. A member that needs several lines starts one of its own.
    A broken list of objects or lists (widgets, metric rows) has each on a line of its own.
    `tail`: the characters (closing brackets, a comma) that will follow on value's last line."""
    flat = _flat(value)
    if column + len(flat) + tail <= width or not isinstance(value, (dict, list)) or not value:
        return [flat]
    is_dict = isinstance(value, dict)
    members = [(_flat(k) + ": ", v) for k, v in value.items()] if is_dict else [("", v) for v in value]
    pad = " " * (indent + 2)
    lines: list[str] = []
    one_per_line = not is_dict and all(isinstance(v, (dict, list)) for v in value)
    current, start, fresh = ("{" if is_dict else "["), column, one_per_line  # start: where `current` begins
    for n, (head, member) in enumerate(members):
        sep = ", " if n else ""
        after = tail + 1 if n == len(members) - 1 else 1  # this container's closer, or a comma
        at = start + len(current) + len(sep) + len(head)
        inline = _lines(member, at, indent + 2, width, after)
        if not fresh and len(inline) == 1 and at + len(inline[0]) + after <= width:
            current += sep + head + inline[0]
            continue
        lines.append(current + ("," if n else ""))
        block = _lines(member, len(pad) + len(head), indent + 2, width, after)
        block[0] = pad + head + block[0]
        lines.extend(block[:-1])
        current, start, fresh = block[-1], 0, one_per_line or len(block) > 1
    lines.append(current + ("}" if is_dict else "]"))
    return lines


def layout(value: Any, width: int = WIDTH) -> str:
    """value as JSON text in lines of at most `width` (a string longer than that stays whole)."""
    return "\n".join(_lines(value, 0, 0, width)) + "\n"


def render(template: str, dashboard: Any) -> str:
    """template with the lines between its markers replaced by DashboardBody holding `dashboard`."""
    lines = template.splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines) if line.rstrip("\n") in (BEGIN, END)]
    if len(marks) != 2 or lines[marks[0]].rstrip("\n") != BEGIN:
        raise ValueError(f"the template needs one {BEGIN.strip()!r} line and, after it, one {END.strip()!r} line")
    body = [BODY_INDENT + line + "\n" for line in layout(dashboard, WIDTH - len(BODY_INDENT)).splitlines()]
    return "".join(lines[:marks[0] + 1] + ["      DashboardBody: !Sub |\n"] + body + lines[marks[1]:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the template's copy differs")
    parser.add_argument("--template", type=Path, default=REPO / "template.yaml")
    parser.add_argument("--dashboard", type=Path, default=REPO / "dashboard.json")
    args = parser.parse_args(argv)
    current = args.template.read_text()
    rendered = render(current, json.loads(args.dashboard.read_text()))
    if args.check:
        if rendered != current:
            print(f"{args.template} does not carry {args.dashboard}: run tools/render_dashboard.py", file=sys.stderr)
            return 1
        return 0
    if rendered != current:
        args.template.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
