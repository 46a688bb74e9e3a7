"""What the template tests share: template.yaml expanded as CloudFormation would, resources resolved by logical id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atelier.local.template import Expanded, Resolver, expand
from tests.support import IMAGES

REPO = Path(__file__).resolve().parents[2]
FUNCTIONS_DIR = REPO / "functions"
LOCAL_ENDPOINT = "http://host.docker.internal:5100"


def expand_with(overrides: dict[str, str]) -> Expanded:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # samtranslator asks boto for a region
        return expand(REPO / "template.yaml", {**IMAGES, **overrides}, "atelier", "us-east-1", "123456789012")


def resolve(expanded: Expanded) -> dict[str, dict[str, Any]]:
    """Every resource with intrinsics resolved: Ref -> logical id, GetAtt -> `<logical id>.<attribute>`."""
    resolver = Resolver(expanded.parameters, expanded.conditions, mappings=expanded.mappings, ref=lambda name: name,
                        get_att=lambda name, attribute: f"{name}.{attribute}")
    return {logical: {**resource, "Properties": resolver.resolve(resource.get("Properties", {}))}
            for logical, resource in expanded.resources.items()}


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    return resolve(expand_with({}))


def of_type(resources: dict[str, dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {logical: r["Properties"] for logical, r in resources.items() if r["Type"] == kind}


def logical_of_arn(value: str) -> str:
    """`UploadsDLQ.Arn` -> `UploadsDLQ` (what GetAtt resolves to here)."""
    assert value.endswith(".Arn"), value
    return value.removesuffix(".Arn")

def function_environments(resources: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: f["Environment"]["Variables"] for name, f in of_type(resources, "AWS::Lambda::Function").items()}
