"""`atelier generate` against the local SageMaker: an endpoint that is not InService yet is named as
such, with how long it has been in that state (SageMaker's own answer is "not found")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from tests.local.sagemaker_helpers import aws, moto_url, overrides, put_model, s3, service, sm  # noqa: F401  (fixtures)

from atelier import cli


def test_generate_while_the_endpoint_is_creating_says_so_and_for_how_long(
        sm: Any, s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an endpoint whose container takes a minute to pass /ping
    put_model(s3, sm, "model-v1", "v1", environment={"FAKE_READY_DELAY": "60"})
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="model-v1")

    code = cli.main(["generate", "a red circle", "-o", str(tmp_path / "x.png"), "--endpoint", "atelier"])

    printed = capsys.readouterr()
    assert code == 2 and "Traceback" not in printed.err and len(printed.err.splitlines()) == 1, printed.err
    assert re.fullmatch(r"error: endpoint 'atelier': it is Creating, for \d+ s now \(since \d\d:\d\d:\d\d UTC\); it "
                        r"takes invocations once InService: `atelier status --watch` follows it\n", printed.err)
    assert not (tmp_path / "x.png").exists()


def test_generate_with_an_unknown_endpoint_says_nothing_was_deployed(
        sm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "a red circle", "-o", str(tmp_path / "x.png"), "--endpoint", "missing"]) == 2
    assert capsys.readouterr().err.startswith("error: endpoint 'missing': no such endpoint: nothing was deployed")
