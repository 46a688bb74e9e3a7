"""`atelier local up` in one process, the other commands in others, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from atelier.catalog import make_catalog, write_catalog

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=40)]


def atelier(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "atelier.cli", "--state-dir", str(state), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def local_up(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "local"
    # started with SIGINT ignored, as a background job of a non-interactive shell (CI) starts it:
    # the SIGINT below must stop it all the same
    process = subprocess.Popen([sys.executable, "-m", "atelier.cli", "--state-dir", str(state), "local", "up",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 90
    while not (state / "stack.json").exists():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "atelier local up did not start within 90 s"
        time.sleep(0.5)
    time.sleep(2)  # the function workers start after the state file is written
    yield state
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "sam local invoke --config-env local" in output  # the exact command for SAM users
    assert "(samconfig.toml [local] and events/env.json)" in output  # not eaten as rich markup


def test_local_env_prints_exports_for_the_running_stack(local_up: Path) -> None:
    result = atelier("local", "env", state=local_up)
    exports = dict(line.removeprefix("export ").split("=", 1) for line in result.stdout.splitlines())
    assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
    assert exports["AWS_ENDPOINT_URL_SAGEMAKER"].startswith("http://127.0.0.1:")


def test_partner_then_upload_then_status_through_the_cli(local_up: Path, tmp_path: Path) -> None:
    added = atelier("--local", "partner", "add", "acme", "--license", "CC-BY-4.0", state=local_up)
    assert added.returncode == 0, added.stderr
    listed = json.loads(atelier("--local", "partner", "list", "--json", state=local_up).stdout)
    assert [(p["partner_id"], p["licenses"], p["prefixes"]) for p in listed] == [("acme", ["CC-BY-4.0"], [""])]
    write_catalog(make_catalog(3), tmp_path / "catalog")
    (tmp_path / "catalog" / "notes.txt").write_text("not an image")
    uploaded = atelier("--local", "upload", str(tmp_path / "catalog"), "--partner", "acme", state=local_up)
    assert uploaded.returncode == 0, uploaded.stderr
    assert "7 objects uploaded for partner acme" in uploaded.stdout
    refused = atelier("--local", "upload", str(tmp_path / "catalog" / "shapes"), "--partner", "nobody", state=local_up)
    assert refused.returncode == 2 and "partner 'nobody' is not registered" in refused.stderr, refused.stderr
    # with --force the files go, after a warning, and are quarantined as the warning said
    unlicensed = atelier("--local", "upload", str(tmp_path / "catalog" / "shapes"), "--partner", "nobody", "--force",
                         state=local_up)
    assert unlicensed.returncode == 0, unlicensed.stderr
    warning = unlicensed.stderr.splitlines()[0]
    assert warning.startswith("warning: partner 'nobody' is not registered, so all ") and warning.endswith(
        "files would be quarantined as unlicensed (uploading anyway: --force)"), unlicensed.stderr
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(atelier("--local", "status", "--json", state=local_up).stdout)
        if sum(status["uploads"].values()) == 7 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status["uploads"] == {"accepted": 3, "quarantined": 4}
    assert status["quarantined"] == {"not_an_image": 1, "unlicensed": 3}
    table = atelier("--local", "status", state=local_up)
    assert "accepted 3" in table.stdout and "unlicensed 3" in table.stdout


def test_a_bad_partner_id_is_a_clear_error(local_up: Path, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(make_catalog(1)[0].image)
    result = atelier("--local", "upload", str(tmp_path / "a.png"), "--partner", "Not A Partner", state=local_up)
    assert result.returncode == 2
    assert "partner id 'Not A Partner' must be lower-case" in result.stderr


def test_commands_without_a_stack_say_how_to_start_one(tmp_path: Path) -> None:
    result = atelier("--local", "status", state=tmp_path / "nothing")
    assert result.returncode == 2
    assert "atelier local up" in result.stderr


# --- a stop signal ends every process the command started ---------------------------------------

def process_table() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, start time). A pid reused later has another start time."""
    table = {}
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:  # it ended meanwhile
            continue
        if fields and fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """The processes under pid (children started in sessions of their own included), with start times."""
    table, found, parents = process_table(), {}, [pid]
    while parents:
        parent = parents.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                parents.append(child)
    return found


def still_running(processes: dict[int, str]) -> dict[int, str]:
    table = process_table()
    return {pid: start for pid, start in processes.items() if pid in table and table[pid][1] == start}


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def eventually(condition, seconds: float = 120) -> bool:  # noqa: ANN001
    """Poll until the condition holds (a generous deadline: the design promises an end, not a time)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.slow(seconds=90)
@pytest.mark.parametrize(("command", "stop"), [
    (("demo", "--images", "8", "--quiet"), signal.SIGTERM),
    (("demo", "--images", "8", "--quiet"), signal.SIGHUP),  # the terminal it ran in closed
    (("local", "up", "--port", "0"), signal.SIGHUP),
])
def test_a_stop_signal_ends_every_process_the_stack_started_and_frees_its_ports(
        tmp_path: Path, command: tuple[str, ...], stop: signal.Signals) -> None:
    # GIVEN the command running with its whole stack up (moto, a worker per function; the local SageMaker)
    state, log = tmp_path / "state", tmp_path / "output.log"
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "atelier.cli", "--state-dir", str(state), *command],
                                   stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path)
    started: dict[int, str] = {}
    try:
        assert eventually(lambda: "local stack up" in log.read_text() or process.poll() is not None), log.read_text()
        assert process.poll() is None, log.read_text()
        env = json.loads((state / "stack.json").read_text())["env"]
        ports = [urlparse(env[k]).port for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SAGEMAKER")]
        started = descendants(process.pid)
        assert len(started) >= 8 and all(port_in_use(p) for p in ports), (started, ports)

        # WHEN the signal arrives
        process.send_signal(stop)

        # THEN the command ends, and with it every process it started; no port stays taken
        process.wait(timeout=120)
        assert eventually(lambda: not still_running(started)), still_running(started)
        assert eventually(lambda: not any(port_in_use(p) for p in ports)), ports
        assert process.returncode == (128 + stop if command[0] == "demo" else 0), log.read_text()
    finally:
        started = started or descendants(process.pid)  # a failure before they were counted leaves none behind
        if process.poll() is None:
            process.kill()
        for pid in still_running(started):  # only what this test started, by id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
