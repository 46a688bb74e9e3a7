"""docs/architecture.md's flow diagram and code map name real modules, and the code map every package of the
trainer: a rename or a new package that forgets the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def diagram() -> str:
    text = DOC.read_text()
    return text[text.index("```mermaid"):text.index("```", text.index("```mermaid") + 3)]


def code_map() -> str:
    text = DOC.read_text()
    start = text.index("## Code map")
    return text[start:text.index("\n## ", start + 1)]


def named_modules(text: str) -> set[str]:
    """`core.x.y` / `contracts.x` dotted names (with `, z` siblings) and `dir/file.py` paths."""
    names = set()
    for match in re.finditer(r"\b((?:core|contracts)(?:\.\w+)+)((?:, \w+)*)", text):
        dotted, siblings = match.group(1), match.group(2)
        names.add(dotted)
        names |= {dotted.rsplit(".", 1)[0] + "." + s.strip() for s in siblings.split(",") if s.strip()}
    names |= set(re.findall(r"\b[\w/]+/[\w]+\.py\b", text))
    return names


def exists(name: str) -> bool:
    if name.endswith(".py"):
        return any((root / name).is_file() for root in (REPO, REPO / "functions"))
    module, _, last = name.rpartition(".")
    if last[:1].isupper():  # a class: its module defines it
        source = (REPO / "functions" / module.replace(".", "/")).with_suffix(".py")
        return source.is_file() and f"class {last}(" in source.read_text()
    path = REPO / "functions" / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_module_the_flow_diagram_names_exists() -> None:
    names = named_modules(diagram())

    assert len(names) >= 25
    assert sorted(n for n in names if not exists(n)) == []


def test_a_module_that_is_not_there_is_caught() -> None:
    names = named_modules("a -- core.pack.packer, nowhere --> b; trainer/gone.py; contracts.messages.Nothing")

    assert names == {"core.pack.packer", "core.pack.nowhere", "trainer/gone.py", "contracts.messages.Nothing"}
    assert [n for n in sorted(names) if not exists(n)] == ["contracts.messages.Nothing", "core.pack.nowhere",
                                                           "trainer/gone.py"]


def test_every_module_the_code_map_names_exists() -> None:
    names = named_modules(code_map())

    assert {"trainer/jobs/evaluate.py", "trainer/report/render.py"} <= names
    assert sorted(n for n in names if not exists(n)) == []


def test_the_code_map_names_every_package_of_the_trainer() -> None:
    row = next(line for line in code_map().splitlines() if line.startswith("| `trainer/` |"))
    packages = sorted(path.parent.name for path in (REPO / "trainer").glob("*/__init__.py"))

    assert len(packages) >= 8
    assert [name for name in packages if f"`{name}/`" not in row] == []


def test_the_code_map_names_each_handler_s_stage_package() -> None:
    handlers = sorted(path.parent.name for path in (REPO / "functions").glob("*/app.py"))
    text = code_map()

    assert len(handlers) >= 7
    assert [name for name in handlers if f"`core/{name}/`" not in text and f"`core/{name}.py`" not in text] == []
