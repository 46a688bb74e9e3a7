"""One pin list: the image trains and serves with the ML stack the tests ran (constraints.txt)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "trainer" / "Dockerfile").read_text()


def pins() -> dict[str, str]:
    found = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt pins exact versions only: {line!r}"
            found[name.lower()] = pinned
    return found


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert match, f"trainer/Dockerfile has no ARG {name}"
    return match.group(1)


def test_the_pin_list_holds_the_stack_that_must_match() -> None:
    assert {"torch", "diffusers", "transformers", "tokenizers"} <= set(pins())


@pytest.mark.parametrize("name", sorted(pins()))
def test_the_tests_run_the_pinned_version(name: str) -> None:
    assert version(name).split("+")[0] == pins()[name]  # torch's local build is 2.13.0+cpu


def test_the_training_base_ships_the_pinned_torch() -> None:
    base, base_torch = dockerfile_arg("TRAIN_BASE"), dockerfile_arg("BASE_TORCH")
    # an AWS PyTorch DLC tag names its torch's major.minor: pytorch:2.13-cu133-amzn2023-sagemaker
    match = re.fullmatch(r"public\.ecr\.aws/deep-learning-containers/pytorch:(\d+\.\d+)-cu\d+-amzn2023-sagemaker", base)
    assert match, f"TRAIN_BASE {base} is not an AWS PyTorch DLC for SageMaker"
    assert base_torch == pins()["torch"] and base_torch.startswith(match.group(1) + ".")
    assert "'${BASE_TORCH}'" in DOCKERFILE  # the build refuses a base whose torch is another


def test_both_images_install_with_the_pin_list() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    assert [stage.split()[2] for stage in stages] == ["train", "serve"]
    for stage in stages:
        assert "COPY constraints.txt trainer/requirements.txt" in stage
        assert "pip install -c /opt/program/trainer/constraints.txt" in stage
    assert "pip install -c /opt/program/trainer/constraints.txt torch " in stages[1]  # the slim base has none


def test_make_installs_with_the_pin_list() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "TORCH  ?= $(shell grep -m1 '^torch==' constraints.txt)" in makefile
    installs = [line for line in makefile.splitlines() if "$(INSTALL) --python $(PY)" in line]
    assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs)  # torch, then the project


def test_pyproject_s_ranges_admit_the_pins() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requirements = [Requirement(text) for text in extras["trainer"]]
    ranged = {r.name.lower(): r.specifier for r in requirements}
    for name, pinned in pins().items():
        if name in ranged:
            assert ranged[name].contains(pinned), f"pyproject.toml's {name}{ranged[name]} excludes the pin {pinned}"
    image = {Requirement(line).name.lower() for line in (REPO / "trainer" / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    assert image == set(ranged) - {"torch"}  # the image's list mirrors the extra (torch: the base's)
