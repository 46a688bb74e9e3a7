"""The distribution as `pip install atelier` makes it: the sdist and the wheel built from it (as a
packager builds them), installed with the base dependencies alone into a fresh virtual environment,
from the sources `make` installs from (tools/pip_sources.py, uv). docs/packaging.md says why the
wheel holds one top-level package."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from atelier.local.provision import Provisioner
from atelier.local.stack import register_outputs
from atelier.local.template import expand
from tests.support import ACCOUNT, IMAGES, REGION, REPO, STACK, moto_server

pytestmark = pytest.mark.slow(seconds=30)
UV = Path(sys.executable).parent / "uv"  # the Makefile's .venv/bin/uv
# Modules that need an extra: the local stack and the demo (`local`), the trainer (`trainer`; the CLI
# imports its report renderer, atelier.reports, which is checked)
NEEDS_AN_EXTRA = ("atelier.local.", "atelier.demo", "atelier.prompt_match", "atelier._shared.trainer.")
EVERY_HELP = """
import argparse, contextlib, io, json
from atelier.cli import main, parser

def paths(command, path):
    subcommands = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands:
        return [path]
    return [p for a in subcommands for name, sub in a.choices.items() for p in paths(sub, [*path, name])]

codes = {}
for path in paths(parser(), []):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main([*path, "--help"])
    except SystemExit as exit:
        codes[" ".join(path)] = exit.code
print(json.dumps(codes))
"""
EVERY_IMPORT = """
import importlib, json, pkgutil, sys
import atelier
failed = {}
for module in pkgutil.walk_packages(atelier.__path__, "atelier."):
    if not module.name.startswith(tuple(sys.argv[1:])):
        try:
            importlib.import_module(module.name)
        except Exception as error:
            failed[module.name] = repr(error)
print(json.dumps({"failed": failed, "top_level": sorted({name.split(".")[0] for name in sys.modules})}))
"""


def sources() -> list[str]:
    """pip's package sources as uv arguments, as the Makefile passes them."""
    printed = subprocess.run([sys.executable, REPO / "tools" / "pip_sources.py"], capture_output=True, text=True,
                             check=True)
    return shlex.split(printed.stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`uv build`: the sdist, then the wheel built from it in a folder of its own."""
    out = tmp_path_factory.mktemp("dist")
    build_sources = ["--build-constraints" if a == "--constraint" else a for a in sources()]
    subprocess.run([UV, "build", "--quiet", *build_sources, "--out-dir", out, REPO], check=True)
    return next(out.glob("atelier-*.whl"))


@pytest.fixture(scope="module")
def base(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the wheel and its base dependencies, no extra: its bin folder."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, venv], check=True)
    subprocess.run([UV, "pip", "install", "--quiet", *sources(), "--python", venv / "bin" / "python",
                    "-c", REPO / "constraints.txt", wheel], check=True)
    return venv / "bin"


def run(command: list[str | Path], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command of the base environment, outside the checkout (nothing of it on the path: not the PYTHONPATH a
    run of the suite may set for its own subprocesses either)."""
    env = env if env is not None else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(command, capture_output=True, text=True, cwd="/", env=env, timeout=120)


def aws_env(**values: str) -> dict[str, str]:
    kept = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k not in {"PYTHONPATH"}}
    return {**kept, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION, **values}


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()

    assert {name.split("/")[0] for name in names} == {"atelier", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "atelier/_shared/core/deploy/requests.py" in names
    assert "atelier/_shared/trainer/configs/runs/tiny-progressive.json" in names


def test_every_command_s_help_runs_with_the_base_dependencies(base: Path) -> None:
    done = run([base / "python", "-c", EVERY_HELP])

    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout)
    assert {"status", "local up", "upload", "partner add", "dlq redrive", "report"} <= set(codes)
    assert {path: code for path, code in codes.items() if code != 0} == {}
    assert run([base / "atelier", "--help"]).returncode == 0


def test_the_cli_s_modules_import_with_the_base_dependencies_and_bring_no_top_level_name(base: Path) -> None:
    done = run([base / "python", "-c", EVERY_IMPORT, *NEEDS_AN_EXTRA])

    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)
    assert imported["failed"] == {}
    assert not {"core", "contracts", "trainer"} & set(imported["top_level"])


def test_status_without_a_reachable_aws_says_so_in_one_line(base: Path) -> None:
    done = run([base / "atelier", "status"], aws_env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1"))

    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot reach http://127.0.0.1:9")
    assert "Traceback" not in done.stderr


@pytest.fixture
def deployed(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """template.yaml's resources and the stack's outputs on a moto server: its URL."""
    with moto_server() as url:
        # moto's server keeps its state in the process: empty what a test before this one on the worker left
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        expanded = expand(REPO / "template.yaml", IMAGES, STACK, REGION, ACCOUNT)
        provisioned = Provisioner(expanded, STACK, REGION, ACCOUNT, boto3.client).provision()
        register_outputs(STACK, provisioned.outputs)
        yield url


def test_status_reads_the_stack_with_the_base_dependencies(base: Path, deployed: str) -> None:
    done = run([base / "atelier", "--stack", STACK, "status", "--json"], aws_env(AWS_ENDPOINT_URL=deployed))

    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert (status["uploads"], status["samples"], status["jobs"], status["endpoints"]) == ({}, 0, [], [])
