"""Import boundaries of functions/: boto3 is imported by core.aws alone (STYLE.md, "The shape of the house")."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FUNCTIONS_DIR = REPO / "functions"
AWS_PACKAGE = FUNCTIONS_DIR / "core" / "aws"
# Callers outside core.aws may catch botocore's exceptions (ClientError and the like), nothing more.
ALLOWED_ELSEWHERE = {"botocore.exceptions"}


def aws_sdk_imports(path: Path) -> set[str]:
    """The boto3 and botocore modules one file imports (absolute imports, `import x.y` and `from x.y import z`)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return {m for m in modules if m.split(".")[0] in {"boto3", "botocore"}}


def sdk_imports_by_file() -> dict[str, set[str]]:
    return {str(path.relative_to(REPO)): found for path in sorted(FUNCTIONS_DIR.rglob("*.py"))
            if (found := aws_sdk_imports(path))}


def test_only_core_aws_imports_boto3() -> None:
    outside = {path: sorted(modules - ALLOWED_ELSEWHERE) for path, modules in sdk_imports_by_file().items()
               if not (REPO / path).is_relative_to(AWS_PACKAGE) and modules - ALLOWED_ELSEWHERE}

    assert outside == {}


def test_the_walk_sees_core_aws_s_own_boto3_imports() -> None:
    # the check above finds imports at all: core.aws makes its clients with boto3
    inside = {path: modules for path, modules in sdk_imports_by_file().items()
              if (REPO / path).is_relative_to(AWS_PACKAGE)}

    assert "boto3" in inside["functions/core/aws/clients.py"]
