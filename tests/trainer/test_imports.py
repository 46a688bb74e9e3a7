"""What the image's program may import: nothing Lambda-side, only `contracts` of functions/ (trainer/Dockerfile)."""

import ast
import re
from pathlib import Path

from tests.support import REPO

TRAINER = REPO / "trainer"
# launch.py runs on an operator's machine, never in the image: it sends the StartTrainingFunction's own
# request (core.start_training.job_requests.training_job_request), so it imports that builder instead of a copy.
OPERATOR_ONLY = {TRAINER / "launch.py"}
LAMBDA_SIDE = {p.name for p in (REPO / "functions").iterdir() if p.is_dir() and p.name[0] not in "._"} - {"contracts"}


def imports_of(path: Path) -> set[str]:
    """The absolute module names a file imports (relative imports stay inside trainer/)."""
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level}


def image_modules() -> list[Path]:
    return sorted(set(TRAINER.rglob("*.py")) - OPERATOR_ONLY)


def test_no_module_the_image_runs_imports_lambda_side_code() -> None:
    found = {path.relative_to(REPO).as_posix(): sorted(name for name in imports_of(path)
                                                       if name.split(".")[0] in LAMBDA_SIDE)
             for path in image_modules()}

    assert "core" in LAMBDA_SIDE and "deploy" in LAMBDA_SIDE
    assert {path: names for path, names in found.items() if names} == {}


def test_the_operator_only_module_is_imported_by_no_module_of_the_image() -> None:
    importers = [path.relative_to(REPO).as_posix() for path in image_modules()
                 if {"trainer.launch"} & imports_of(path) or "launch" in _from_trainer_imports(path)]

    assert importers == []


def _from_trainer_imports(path: Path) -> set[str]:
    """Names taken with `from trainer import ...` or `from . import ...`."""
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module == "trainer" or (node.level and not node.module)) for alias in node.names}


def test_the_image_copies_of_functions_only_contracts_and_only_when_the_program_imports_it() -> None:
    needs_contracts = any(name.split(".")[0] == "contracts" for path in image_modules() for name in imports_of(path))
    copied = re.findall(r"^COPY (functions/\S*) ", (TRAINER / "Dockerfile").read_text(), re.M)

    assert copied == (["functions/contracts/"] * 2 if needs_contracts else [])  # the train and serve targets
