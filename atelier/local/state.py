"""What a running local stack leaves for other processes: its environment in <state>/stack.json.

Apart from stack.py so that `atelier` reads it (`--local`, `atelier local env`) without importing the
stack itself, which needs the `local` extra (moto, werkzeug): a CLI installed alone can use a stack
started from a checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

STATE_FILE = "stack.json"


class StackError(RuntimeError):
    """The local stack could not start, or a part of it died."""


def read_env(state_dir: Path) -> dict[str, str]:
    """The environment a running local stack wrote, for other processes to use."""
    state_file = state_dir / STATE_FILE
    if not state_file.exists():
        raise StackError(f"no local stack state in {state_dir}: start one with `atelier local up`")
    return json.loads(state_file.read_text())["env"]
