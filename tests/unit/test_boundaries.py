"""Import boundaries: in functions/, boto3 is imported by core.aws alone (STYLE.md, "The shape of the house"),
and each handler `functions/<name>/app.py` takes its stage logic from `core.<name>` alone; in trainer/, no module
imports itself back through others, lazily inside a function or not."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FUNCTIONS_DIR = REPO / "functions"
TRAINER_DIR = REPO / "trainer"
AWS_PACKAGE = FUNCTIONS_DIR / "core" / "aws"
# Callers outside core.aws may catch botocore's exceptions (ClientError and the like), nothing more.
ALLOWED_ELSEWHERE = {"botocore.exceptions"}


def absolute_imports(path: Path) -> dict[str, set[str]]:
    """module -> the names one file takes from it (none for `import x.y`), for its absolute imports at any depth
    of the file: a lazy import inside a function counts."""
    modules: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return modules


def aws_sdk_imports(path: Path) -> set[str]:
    """The boto3 and botocore modules one file imports (absolute imports, `import x.y` and `from x.y import z`)."""
    return {m for m in absolute_imports(path) if m.split(".")[0] in {"boto3", "botocore"}}


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


# What every handler may use besides its own stage's package (the `contracts` package is shared too).
SHARED_CORE = {"errors", "telemetry", "settings", "queue_batch", "aws"}


def core_packages(path: Path) -> set[str]:
    """The `core` subpackages and modules one file imports: `from core.x.y import z` and `from core import x`
    both name `x`."""
    found = set()
    for module, names in absolute_imports(path).items():
        parts = module.split(".")
        if parts[0] != "core":
            continue
        found |= {parts[1]} if len(parts) > 1 else names
    return found


def foreign_stage_imports(app: Path) -> set[str]:
    """The stage packages a handler imports that are not named like its folder."""
    return core_packages(app) - SHARED_CORE - {app.parent.name}


def test_each_handler_takes_its_stage_logic_from_the_core_package_named_like_its_folder() -> None:
    handlers = sorted(FUNCTIONS_DIR.glob("*/app.py"))

    assert len(handlers) >= 7
    assert {app.parent.name: sorted(found) for app in handlers if (found := foreign_stage_imports(app))} == {}
    assert [app.parent.name for app in handlers if not (FUNCTIONS_DIR / "core" / app.parent.name).is_dir()
            and not (FUNCTIONS_DIR / "core" / f"{app.parent.name}.py").is_file()] == []


def test_a_handler_reaching_into_another_stage_s_package_is_caught(tmp_path: Path) -> None:
    app = tmp_path / "sweep" / "app.py"
    app.parent.mkdir()
    app.write_text("from core import telemetry\nfrom core.errors import BadMessage\nfrom core.sweep.sweeper import sweep\n"
                   "from contracts.messages import Sample\nfrom core.ingest.admission import ingest_notification\n"
                   "def handler():\n    from core import pack\n")

    assert foreign_stage_imports(app) == {"ingest", "pack"}


def trainer_module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def trainer_imports(path: Path, modules: set[str]) -> set[str]:
    """The trainer modules one file imports; `from trainer.pkg import name` counts the module `trainer.pkg.name`
    where there is one."""
    imports = absolute_imports(path)
    return (set(imports) | {f"{module}.{name}" for module, names in imports.items() for name in names}) & modules


def trainer_import_graph() -> dict[str, set[str]]:
    paths = {trainer_module(path): path for path in sorted(TRAINER_DIR.rglob("*.py"))}
    return {module: trainer_imports(path, set(paths)) - {module} for module, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                cycles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_trainer_module_imports_itself_back() -> None:
    assert import_cycles(trainer_import_graph()) == []


def functions_import_graph() -> dict[str, set[str]]:
    """The Lambdas' shared core and contracts; a module's import of its own package (`from core.aws import
    clients` in a sibling) is the package's layout, not a loop through another module."""
    root = REPO / "functions"
    paths = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for package in ("core", "contracts") for path in sorted((root / package).rglob("*.py"))}
    return {module: {imported for imported in trainer_imports(path, set(paths))
                     if imported != module and not module.startswith(imported + ".")}
            for module, path in paths.items()}


def test_no_core_or_contracts_module_imports_itself_back() -> None:
    assert import_cycles(functions_import_graph()) == []


def test_the_walk_sees_the_core_s_imports_and_a_loop_through_them() -> None:
    graph = functions_import_graph()

    assert {"core.ingest.settings", "core.ingest.images"} <= graph["core.ingest.metadata"]
    assert "contracts.messages" in graph["core.redrive.dead_letters"]
    # the loop core/settings.py was once part of, as it would read now if a stage's settings imported its logic
    looped = {**graph, "core.ingest.settings": graph["core.ingest.settings"] | {"core.ingest.metadata"}}
    assert ["core.ingest.metadata", "core.ingest.settings"] in [sorted(cycle) for cycle in import_cycles(looped)]


def test_the_shared_settings_import_no_stage() -> None:
    # each stage reads its own settings (core/<stage>/settings.py); what they share imports none of them
    assert {m for m in functions_import_graph()["core.settings"] if m.startswith("core.")} == {"core.errors"}


def test_the_walk_sees_the_trainer_s_imports_and_a_cycle_through_them() -> None:
    graph = trainer_import_graph()

    assert {"trainer.jobs.step", "trainer.jobs.train_args", "trainer.runtime.distributed"} <= graph["trainer.jobs.train"]
    assert "trainer.jobs.hyperparameters" in graph["trainer.jobs.train_args"]
    assert import_cycles({**graph, "trainer.jobs.step": graph["trainer.jobs.step"] | {"trainer.jobs.train"}}) == [
        ["trainer.jobs.step", "trainer.jobs.train"]]
