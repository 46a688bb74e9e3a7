"""Every bench script imports: a module moved or split under it fails here, not on the GPU machine."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_bench_script_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
