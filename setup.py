"""The `atelier` distribution installs one top-level import package, `atelier` (docs/packaging.md).

The checkout keeps the code the CLI shares with the Lambdas and the images as the top-level packages
those import (`core` and `contracts` from functions/, `trainer`). A wheel carries them as
`atelier._shared.core`, `atelier._shared.contracts` and `atelier._shared.trainer`, and every import
of them in the wheel's modules is renamed at build time: no `core`, `contracts` or `trainer` is
installed into site-packages, and none appears in sys.modules. An editable install is the checkout as
it is (the three names top-level, as the tests, the local stack, the Lambda bundles and the image use them).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

SHARED = {"core": "functions/core", "contracts": "functions/contracts", "trainer": "trainer"}
PREFIX = "atelier._shared"
CONFIGS = ["configs/*.json", "configs/runs/*.json", "configs/defaults/*.json"]  # trainer's model and run presets
RECIPE = "default_recipe.json"  # the recipe that applies while none was set (contracts.recipe_file)


def packages(prefix: str) -> tuple[list[str], dict[str, str]]:
    """Every package, each shared one under `prefix` ("" keeps the checkout's names), and where it lies."""
    found = find_packages(include=["atelier", "atelier.*"])
    folders = {}
    for name, folder in SHARED.items():
        top = f"{prefix}.{name}" if prefix else name
        found += [top] + [f"{top}.{sub}" for sub in find_packages(folder)]
        folders[top] = folder
    return found, folders


def renamed(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in SHARED


def rewrite_imports(source: str, where: str) -> str:
    """The module's source with each absolute import of a shared package renamed under PREFIX."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []  # (line, start, end, text), lines from 1
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and renamed(node.module):
            found = re.compile(r"from[ \t]+").match(lines[node.lineno - 1], node.col_offset)
            if found is None or not lines[node.lineno - 1].startswith(node.module, found.end()):
                raise ValueError(f"{where}:{node.lineno}: write `from {node.module} import ...` on one line")
            edits.append((node.lineno, found.end(), found.end() + len(node.module), f"{PREFIX}.{node.module}"))
        elif isinstance(node, ast.Import):
            for alias in (a for a in node.names if renamed(a.name)):
                if alias.asname is None:  # `import core.aws` binds `core`, which the wheel does not have
                    raise ValueError(f"{where}:{node.lineno}: write `import {alias.name} as ...` or `from ... import`")
                edits.append((alias.lineno, alias.col_offset, alias.end_col_offset,
                              f"{PREFIX}.{alias.name} as {alias.asname}"))
    for line, start, end, text in sorted(edits, reverse=True):  # right to left: earlier offsets stay valid
        lines[line - 1] = lines[line - 1][:start] + text + lines[line - 1][end:]
    return "".join(lines)


class build_shared(build_py):
    """Copies the modules as build_py does, then renames their imports of the shared packages."""

    def build_module(self, module, module_file, package):
        written, copied = super().build_module(module, module_file, package)
        if not self.editable_mode:
            path = Path(written)
            path.write_text(rewrite_imports(path.read_text(encoding="utf-8"), module_file), encoding="utf-8")
        return written, copied


class editable_checkout(editable_wheel):
    """An editable install maps the checkout's own top-level names (`pip install -e .`, `make test`)."""

    def finalize_options(self) -> None:
        dist = self.distribution
        dist.packages, dist.package_dir = packages("")
        dist.package_data = {"trainer": CONFIGS, "contracts": [RECIPE]}
        super().finalize_options()


PACKAGES, FOLDERS = packages(PREFIX)
setup(
    packages=PACKAGES,
    package_dir=FOLDERS,
    package_data={f"{PREFIX}.trainer": CONFIGS, f"{PREFIX}.contracts": [RECIPE]},
    cmdclass={"build_py": build_shared, "editable_wheel": editable_checkout},
)
