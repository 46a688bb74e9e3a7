"""What every bench line is stamped with: the commit it measured and the library versions it ran."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def versions() -> dict:
    import diffusers
    import torch
    found = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    try:
        import wids  # noqa: F401
        from importlib.metadata import version
        found["wids"] = version("wids")
    except Exception:  # noqa: BLE001
        pass
    return found


def commit() -> str:
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if os.environ.get("BENCH_COMMIT"):  # the device machine's copy has no git history: pass it in
        return os.environ["BENCH_COMMIT"]
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
