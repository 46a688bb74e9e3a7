"""What tests share besides fixtures: paths, the local names of the stack, events from events/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EVENTS = REPO / "events"
ACCOUNT, REGION, STACK = "123456789012", "us-east-1", "atelier"


def load_event(name: str) -> dict[str, Any]:
    """An event from events/, by file name without `.json`."""
    return json.loads((EVENTS / f"{name}.json").read_text())
