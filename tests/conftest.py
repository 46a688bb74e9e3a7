"""Shared fixtures: fake credentials, moto, resources from template.yaml, events from events/."""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.loaders
import botocore.session
import pytest
from moto import mock_aws

from atelier.local import recipe as local_recipe
from atelier.local.provision import Provisioned, Provisioner
from atelier.local.runtime import LambdaContext
from atelier.local.template import Expanded, expand, set_environment
from core import aws
from tests.support import ACCOUNT, IMAGES, REGION, REPO, STACK, TEST_ENVIRONMENT, TEST_RECIPE

TEST_OVERRIDES = {
    **IMAGES,
    "TrainingQuota": "2",
    # moto's SageMaker knows an old list of instance types only
    "TrainingInstanceType": "ml.m5.xlarge",
    "EndpointInstanceType": "ml.m5.large",
    "EncodeInstanceType": "",  # jobs train on the image shards; the encode tests set it
    "AutoencoderInstanceType": "",  # no lineage trains its own VAE first; the autoencoder tests set it
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers share the cores: each worker, and every process of a local stack
    it starts (training jobs included), gets its share of threads. Two torch processes of two threads
    on two cores run 4x slower than one alone, their OpenMP threads spinning for cores the other
    holds; of one thread each, each runs about as fast as one alone. The worker's own torch gets the
    same count, so a run in the worker and one in a subprocess it starts add in the same order (a
    resumed run is compared bit for bit with an uninterrupted one)."""
    if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(workers))))
        if "torch" in sys.modules:  # a conftest named on the command line (tests/trainer/) imported it first
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than cores. The e2e files spend much of their time waiting on their
    stacks (timeouts, schedules, job subprocesses), and a third worker on two cores keeps both busy
    meanwhile: the whole suite took 536 s with three workers (docs/testing.md)."""
    return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked `slow` first, the longest first; the others after, in their usual order.
    xdist hands out whole files (--dist loadfile) in this order (--no-loadscope-reorder): a long file
    that started last would run alone on one worker while the others sat idle (the chaos storms, last
    in the usual order, kept one core busy for three minutes after the other had finished)."""
    seconds: dict[Path, float] = {}
    for item in items:
        if (mark := item.get_closest_marker("slow")) is not None:
            if "seconds" not in mark.kwargs:
                raise pytest.UsageError(f"{item.nodeid}: say how long its file takes, slow(seconds=...)")
            seconds[item.path] = max(seconds.get(item.path, 0), mark.kwargs["seconds"])
    items.sort(key=lambda item: -seconds.get(item.path, 0))  # stable: a file's tests keep their order


class _SearchPaths(list):
    """A loader's search paths. Every boto3 Session appends its own data folder to its loader's: with
    one loader for all of them, once is enough (the list would otherwise grow with every session)."""

    def append(self, path: str) -> None:
        if path not in self:
            super().append(path)


@functools.cache
def _shared_loader(search_path_string: str | None = None) -> botocore.loaders.Loader:
    """botocore.loaders.create_loader, made once a process for each AWS_DATA_PATH."""
    paths = [] if search_path_string is None else [
        os.path.expanduser(os.path.expandvars(path)) for path in search_path_string.split(os.pathsep)]
    return botocore.loaders.Loader(extra_search_paths=_SearchPaths(paths))


@pytest.fixture(scope="session", autouse=True)
def shared_botocore_loader() -> Iterator[None]:
    """One botocore loader for every session a test process makes. moto's mock_aws clears boto3's
    default session, so each test's clients came from a new session whose new loader read and parsed
    every service's JSON model again: clients for ten services took 0.2-0.3 s, 0.03 s with one loader.
    The models are read-only once loaded (botocore already shares them between the clients
    of one session); clients are still made inside mock_aws, so moto patches them as before."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore.session, "create_loader", _shared_loader)
        yield


@functools.cache
def _expanded() -> Expanded:
    expanded = expand(REPO / "template.yaml", TEST_OVERRIDES, STACK, REGION, ACCOUNT)
    set_environment(expanded, TEST_ENVIRONMENT)
    return expanded


def expanded_template() -> Expanded:
    """template.yaml expanded with TEST_OVERRIDES and TEST_ENVIRONMENT: parsed and transformed once a session (a third of a
    second each time), a fresh copy for every stack, which provisioning must not share."""
    return copy.deepcopy(_expanded())


def provisioned_with_recipe() -> Provisioned:
    """Every resource of template.yaml, and TEST_RECIPE as the current recipe."""
    provisioned = Provisioner(expanded_template(), STACK, REGION, ACCOUNT, boto3.client).provision()
    local_recipe.set_local(provisioned.outputs, TEST_RECIPE)
    return provisioned


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never reach a real account, whatever the developer's shell has set."""
    for name in list(os.environ):
        if name.startswith("AWS_ENDPOINT_URL") or name in {"AWS_PROFILE", "AWS_SESSION_TOKEN"}:
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("POWERTOOLS_SERVICE_NAME", "tests")
    aws.reset_clients()


@pytest.fixture
def lambda_context() -> LambdaContext:
    import time
    return LambdaContext(function_name="test", memory_limit_in_mb=1024,
                         invoked_function_arn=f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:test",
                         aws_request_id="00000000-0000-0000-0000-000000000000", deadline=time.monotonic() + 60)


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> Iterator[Provisioned]:
    """moto with every resource of template.yaml, created by the local stack's own provisioner, and TEST_RECIPE set."""
    with mock_aws():
        yield provisioned_with_recipe()


@pytest.fixture(scope="session", autouse=True)
def atomic_dynamodb() -> Iterator[None]:
    """DynamoDB applies a write's condition and the write as one step; in-process moto checks, then writes, so two
    threads can both pass an `attribute_not_exists` (seen under CI load: both of two concurrent deliveries
    accepted). One lock around each of moto's writes, for every test, as the local stack's moto server takes
    DynamoDB requests one at a time (atelier/local/moto_server.py). Reentrant: a transaction's write calls
    put_item, update_item or delete_item inside it."""
    import threading
    from moto.dynamodb.models import DynamoDBBackend
    lock = threading.RLock()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("put_item", "update_item", "delete_item", "transact_write_items"):
            def locked(self: Any, *args: Any, _write: Any = getattr(DynamoDBBackend, name), **kwargs: Any) -> Any:
                with lock:
                    return _write(self, *args, **kwargs)
            patch.setattr(DynamoDBBackend, name, locked)
        yield


@pytest.fixture(scope="module")
def module_stack() -> Iterator[Provisioned]:
    """`stack`, provisioned once for a whole module (a few seconds each time); a module that uses it
    empties what its tests wrote itself. The credentials are set here too: `aws_credentials` runs
    after module fixtures."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("AWS_ENDPOINT_URL") or name in {"AWS_PROFILE", "AWS_SESSION_TOKEN"}:
                patch.delenv(name)
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": REGION}.items():
            patch.setenv(name, value)
        with mock_aws():
            yield provisioned_with_recipe()


@pytest.fixture
def partner(stack: Provisioned) -> str:
    """partner-a, registered with the licenses the events and pictures use."""
    from core.partners.licensing import Partner, put_partner
    put_partner(stack.outputs["PipelineTableName"],
                Partner(partner_id="partner-a", licenses=("CC-BY-4.0",)))
    return "partner-a"


@pytest.fixture
def function_env(stack: Provisioned, monkeypatch: pytest.MonkeyPatch):
    """Give the test process one function's environment from the template, as Lambda would."""
    def apply(logical_id: str) -> dict[str, str]:
        env = stack.functions[logical_id].environment
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return env
    return apply
