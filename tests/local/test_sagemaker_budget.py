"""The local SageMaker stays lean: atelier/local/sagemaker/ within the line budget docs/local-sagemaker.md states."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atelier" / "local" / "sagemaker"
DOC = ROOT / "docs" / "local-sagemaker.md"


def stated_budget() -> int:
    match = re.search(r"\*\*Line budget: ([\d,]+) lines\*\*", DOC.read_text())
    assert match, "docs/local-sagemaker.md states no line budget"
    return int(match[1].replace(",", ""))


def test_the_package_is_within_its_line_budget() -> None:
    # as `wc -l atelier/local/sagemaker/*.py` counts: every line, blank and comment lines included
    counts = {path.name: len(path.read_text().splitlines()) for path in sorted(PACKAGE.rglob("*.py"))}

    assert sum(counts.values()) <= stated_budget(), (
        f"atelier/local/sagemaker/ has {sum(counts.values())} lines, over the budget in docs/local-sagemaker.md "
        f"('Line budget'): {counts}")
