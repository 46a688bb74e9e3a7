"""Failures a user can fix are one sentence on stderr and exit code 2, never a traceback: a stopped
local stack, an unreachable endpoint, no region. No network: the endpoints are closed loopback ports."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, ParamValidationError

from atelier import cli, failures


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(autouse=True)
def one_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a refused connection is retried otherwise, with backoff


def stopped_stack(state: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The state a local stack leaves behind when its process is gone: stack.json naming dead ports."""
    url = f"http://127.0.0.1:{closed_port()}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_SAGEMAKER": url, "AWS_DEFAULT_REGION": "us-east-1"}
    state.mkdir()
    (state / "stack.json").write_text(json.dumps({"env": env}))
    for key, value in env.items():  # `--local` writes them into os.environ: undone after the test
        monkeypatch.setenv(key, value)
    return url


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    lines = printed.err.splitlines()
    assert len(lines) == 1, printed.err
    return lines[0]


def test_a_stopped_local_stack_says_to_start_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    url = stopped_stack(tmp_path / "state", monkeypatch)

    code = cli.main(["--local", "--state-dir", str(tmp_path / "state"), "status"])

    assert code == 2
    assert one_line(capsys) == (f"error: nothing answers at {url}/: the local stack of {tmp_path / 'state'} is not "
                                f"running; start it with `atelier --state-dir {tmp_path / 'state'} local up` (it stops "
                                "when that process does)")


def test_local_without_a_stack_names_the_kept_demo_s_state_when_there_is_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN no `local up` state, and the state of `atelier demo --keep`
    monkeypatch.setattr(cli, "DEFAULT_STATE", tmp_path / "local")
    monkeypatch.setattr(cli, "DEMO_STATE", tmp_path / "demo")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "stack.json").write_text(json.dumps({"env": {}}))

    code = cli.main(["--local", "status"])

    assert code == 2
    assert one_line(capsys) == (f"error: no local stack state in {tmp_path / 'local'}: start one with `atelier local "
                                f"up`, or reach the stack of `atelier demo --keep` with `--state-dir {tmp_path / 'demo'}`")


def test_an_unreachable_endpoint_says_what_to_check(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)

    assert cli.main(["models"]) == 2
    line = one_line(capsys)
    assert line.startswith(f"error: cannot reach {url}/: check the network and AWS_ENDPOINT_URL")
    assert "--local" in line


def test_no_region_says_how_to_set_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))  # nor a region in ~/.aws/config

    assert cli.main(["status"]) == 2
    assert one_line(capsys) == ("error: no AWS region is set: `export AWS_DEFAULT_REGION=us-east-1` (or `aws "
                                "configure`), or pass --local for a running `atelier local up`")


def test_a_refusal_by_aws_is_named_with_its_code() -> None:
    refused = ClientError({"Error": {"Code": "AccessDenied", "Message": "no s3:ListBucket"}}, "ListObjectsV2")
    missing = ClientError({"Error": {"Code": "NoSuchBucket", "Message": "gone", "BucketName": "b1"}}, "ListObjectsV2")

    assert failures.explain(refused, False, Path(".")) == "AWS refused ListObjectsV2: AccessDenied: no s3:ListBucket"
    assert failures.explain(missing, False, Path(".")).startswith("bucket b1 does not exist here")


def test_a_failure_that_is_our_bug_keeps_its_traceback() -> None:
    assert failures.explain(ParamValidationError(report="Missing required parameter"), False, Path(".")) is None


@pytest.mark.parametrize(("seconds", "said"), [(0, "0 s"), (59.9, "59 s"), (192, "3 min 12 s"), (7500, "2 h 5 min")])
def test_elapsed_time_reads_as_people_say_it(seconds: float, said: str) -> None:
    assert failures.elapsed(seconds) == said


def test_an_unknown_near_duplicate_mode_is_refused_with_the_modes_there_are(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["import", "s3://bucket/shards/", "--partner", "p", "--license", "l", "--near-duplicates", "sometimes"])

    assert exited.value.code == 2
    assert "argument --near-duplicates: invalid choice: 'sometimes' (choose from 'keep', 'flag', 'drop')" \
        in capsys.readouterr().err
