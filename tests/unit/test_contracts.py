"""Every name that crosses a boundary is spelled once, in functions/contracts/: no table key prefix,
tag or S3 prefix is written as a literal anywhere else, and what the trainer takes from contracts
needs nothing beyond the standard library and the image's own requirements (trainer/Dockerfile copies it into
the image)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from contracts import container_paths, pipeline_table, s3_layout
from contracts.aspect_buckets import ASPECT_BUCKETS, aspect_bucket, bucket_ratio
from tests.support import REPO

CONTRACTS = REPO / "functions" / "contracts"
SEARCHED = [REPO / "functions", REPO / "trainer", REPO / "atelier", REPO / "bench"]
KEY_PREFIX = re.compile(r"\b[A-Z][A-Z_]*#")  # SAMPLE#, JOB#, LINEAGE#, PHASHFULL#, ...
TAG = re.compile(r"^atelier:(?!:)")  # atelier:role; not a torch.library namespace (atelier::op)
S3_PREFIXES = sorted(value for name, value in vars(s3_layout).items()
                     if name.isupper() and isinstance(value, str) and value.endswith("/"))
# the files beside a job's model (model.tar.gz, evaluation.json, ...) and the container paths
FILE_NAMES = sorted(value for name, value in vars(s3_layout).items()
                    if name.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z]+(\.[a-z]+)+", value))
CONTAINER_PATHS = sorted(value for name, value in vars(container_paths).items() if name.isupper())
# The local SageMaker plays AWS, whose own contract (ModelArtifacts' model.tar.gz, the default
# LocalPaths) it must honour whatever the pipeline's contracts say.
EMULATOR = REPO / "atelier" / "local" / "sagemaker"


def sources() -> list[Path]:
    return sorted(p for root in SEARCHED for p in root.rglob("*.py") if CONTRACTS not in p.parents)


def emulator(path: Path) -> bool:
    return EMULATOR in path.parents


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the module's, classes' and functions' docstring nodes (prose, not names)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal; an f-string reads with `{}` where its values go."""
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.append((node.lineno, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip | parts:
            found.append((node.lineno, node.value))
    return found


def stray(text: str) -> str | None:
    """What in `text` only contracts may spell, if anything."""
    if match := KEY_PREFIX.search(text):
        return f"table key prefix {match.group()}"
    if TAG.match(text):
        return f"tag {text}"
    for prefix in S3_PREFIXES:
        # a key (`training/<job>/...`) or a URI's key (`s3://{bucket}/training/...`)
        if text.startswith(prefix) or f"}}/{prefix}" in text:
            return f"S3 prefix {prefix}"
    for name in FILE_NAMES:
        if text == name or text.endswith(f"/{name}"):
            return f"file name {name}"
    for path in CONTAINER_PATHS:
        if text == path or text.startswith(f"{path}/"):
            return f"container path {path}"
    return None


def test_no_name_of_the_contracts_is_spelled_outside_them() -> None:
    found = [f"{path.relative_to(REPO)}:{line}: {what}: {text!r}"
             for path in sources() for line, text in literals(path)
             if (what := stray(text)) and not (emulator(path) and what.startswith(("file name", "container path")))]

    assert found == []


@pytest.mark.parametrize("text", ["JOB#", "f'LINEAGE#{}'", "atelier:role", "training/", "s3://{}/checkpoints/{}/",
                                  "model.tar.gz", "{}/evaluation.json", "/opt/ml/output/tensorboard"])
def test_the_search_finds_each_kind_of_name(text: str) -> None:
    assert stray(text.removeprefix("f'").removesuffix("'")) is not None


def test_the_search_leaves_expressions_and_local_paths_alone() -> None:
    ignored = ("SET #s = :pending", "{}#{}", "/opt/ml/model", "atelier-quarantine", "report.html.tmp",
               "atelier::groupnorm_silu")
    assert [stray(t) for t in ignored] == [None] * len(ignored)


def test_each_key_reads_back_the_name_it_was_built_from() -> None:
    assert pipeline_table.job_name(pipeline_table.job_pk("atelier-0123-s1")) == "atelier-0123-s1"
    assert pipeline_table.lineage_name(pipeline_table.lineage_pk("main")) == "main"
    assert pipeline_table.sample_sha256(pipeline_table.sample_pk("ab" * 32)) == "ab" * 32
    assert pipeline_table.shard_id_of(pipeline_table.shard_pk("shard-1")) == "shard-1"
    key = "partner-a/x/red.png"
    assert pipeline_table.upload_key(pipeline_table.upload_pk("uploads", key)) == key


def test_the_import_records_nest_under_their_batch() -> None:
    batch = pipeline_table.import_batch_pk("b1")
    assert (batch, pipeline_table.import_shard_pk("b1", "s3://in/0.tar")) == ("IMPORT#b1", "IMPORT#b1#s3://in/0.tar")


def test_a_full_index_key_counts_under_its_band_and_sub_band() -> None:
    key = pipeline_table.phash_pk(2, "89ab", 3, "cde")
    assert (key, pipeline_table.phash_full_pk(key)) == ("PHASH#2#89ab#3#cde", "PHASHFULL#2#3")


def test_every_aspect_bucket_reads_back_as_its_own_ratio() -> None:
    assert {name: bucket_ratio(aspect_bucket(round(ratio * 1000), 1000)) for name, ratio in ASPECT_BUCKETS.items()} \
        == ASPECT_BUCKETS
    assert [bucket_ratio(b) for b in ("512x1024", [1, 2], None, "")] == [None] * 4  # no other spelling means one


def contracts_the_trainer_imports() -> set[str]:
    """The contracts modules the image's program imports (trainer/launch.py runs on an operator's machine)."""
    names = set()
    for path in set((REPO / "trainer").rglob("*.py")) - {REPO / "trainer" / "launch.py"}:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("contracts"):
                names |= {node.module} if node.module != "contracts" else {f"contracts.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.startswith("contracts.")}
    return names


def image_requirements() -> set[str]:
    """The distributions trainer/requirements.txt installs into the image (torch: the base's)."""
    lines = (REPO / "trainer" / "requirements.txt").read_text().splitlines()
    return {re.split(r"[<>=!~\[ ]", line.strip())[0].lower() for line in lines if line.strip() and not line.startswith("#")}


def test_what_the_trainer_takes_from_contracts_needs_only_the_standard_library_and_pydantic() -> None:
    imported, outside, left = set(), {}, sorted(contracts_the_trainer_imports())
    while left:  # and what those contracts modules import of contracts, in turn
        module = left.pop()
        imported.add(module)
        tree = ast.parse((CONTRACTS / f"{module.removeprefix('contracts.')}.py").read_text())
        tops = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        tops |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        left += sorted({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                        and n.module.startswith("contracts.")} - imported - set(left))
        # pydantic: the training recipe's models (contracts.recipe), which the image installs
        outside[module] = sorted(tops - set(sys.stdlib_module_names) - {"__future__", "contracts"} - {"pydantic"})

    assert "contracts.shard_members" in imported and "contracts.recipe" in imported
    assert "pydantic" in image_requirements()
    assert outside == {module: [] for module in imported}
