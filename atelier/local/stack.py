"""The embedded local stack: moto as the local AWS, the template's resources, Lambda-like workers,
and a local SageMaker. Every component reaches AWS through AWS_ENDPOINT_URL, as on real AWS.

    with LocalStack(StackOptions(root=repo, state_dir=repo / ".atelier")) as stack:
        stack.env  # the variables that point boto3 (and the atelier CLI) at it
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import boto3

from atelier.local import enforcement
from atelier.local import recipe as local_recipe
from atelier.local.alarms import AlarmEvaluator
from atelier.local.chaos import CHAOS_ENV
from atelier.local.provision import Provisioned, Provisioner
from atelier.local.sagemaker import LocalSageMaker, Settings
from atelier.local.state import STATE_FILE, StackError
from atelier.local.template import expand, load_overrides, load_tuning, set_environment
from atelier.local.worker import SCHEDULE_SCALE_ENV

log = logging.getLogger("atelier.local")
MOTO_ACCOUNT = "123456789012"  # moto's default account id
OUTPUTS_TEMPLATE_RESOURCE = {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}}


SIGNING_PARAMETER = "C2paSigningSecretArn"
LOCAL_BASES_BUCKET = "atelier-local-bases"  # `--base DIR` uploads there (AWS: any bucket the SageMaker role reads)


@dataclass
class StackOptions:
    root: Path
    state_dir: Path
    stack: str = "atelier"
    region: str = "us-east-1"
    config_env: str = "local"  # the samconfig.toml environment whose parameter overrides apply
    overrides: dict[str, str] = field(default_factory=dict)
    moto_port: int = 5100  # fixed by default so events/env.json can name it for `sam local invoke`
    sagemaker_port: int = 5101
    alarm_evaluation_seconds: float = 5.0  # moto never evaluates alarms; the local evaluator does, this often
    # Opt-in, for tests and benchmarks (default: the template as it is, AWS's timings, no faults):
    property_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # logical id -> properties
    schedule_scale: float = 1.0  # rate(...) schedules fire this much more often (0.05: every 3 s for 1 minute)
    chaos_file: Path | None = None  # fault injection (atelier/local/chaos.py)
    # Lambda runs an SQS-triggered function in as many execution environments at once as its queue
    # keeps busy, up to the mapping's MaximumConcurrency and the function's reserved concurrency;
    # locally, also at most this many worker processes a function (docs/local.md). 1: on a 2-core
    # machine a second process per function only contends for moto (bench/RESULTS.md, load test).
    concurrency: int = 1
    # A diffusers pipeline folder (or some of its parts): uploaded once moto is up, before the template
    # is provisioned, and given to every job as PretrainedModelUri (`atelier local up --base DIR`).
    base: Path | None = None
    # moto checks every request against IAM, the stack running as an administrator user
    # (atelier/local/enforcement.py): partner roles are then held to their policies, as on AWS.
    enforce_iam: bool = False
    # Served PNGs signed with C2PA (`atelier local up --sign`): a throwaway identity (atelier/local/signing.py)
    # in a Secrets Manager secret, made once moto is up and given as C2paSigningSecretArn; its root CA
    # in <state_dir>/c2pa-root.pem, to verify with.
    sign_images: bool = False
    # Recipe changes over recipes/<config_env>.toml's (atelier/local/recipe.py), e.g. {"training": {"run_plan": []}}
    recipe: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Tuning knobs over tuning/<config_env>.toml's, in every function's environment, e.g. {"SHARD_MAX_SAMPLES": "8"}
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE


class LocalStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.moto: subprocess.Popen[bytes] | None = None
        self.sagemaker: LocalSageMaker | None = None
        self.alarms: AlarmEvaluator | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.provisioned: Provisioned | None = None
        self.env: dict[str, str] = {}
        self._saved_env: dict[str, str | None] = {}

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "LocalStack":
        opts = self.options
        (opts.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        moto_url = self._start_moto()
        keys = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local"}
        if opts.enforce_iam:
            keys = enforcement.enforce(moto_url, opts.region)
        self._set_env({"AWS_ENDPOINT_URL": moto_url, **keys, "AWS_DEFAULT_REGION": opts.region, "AWS_REGION": opts.region})
        if opts.base is not None:
            self.options = opts = replace(opts, overrides={**opts.overrides, "PretrainedModelUri": self._upload_base(opts.base)})
        if opts.sign_images:
            self.options = opts = replace(opts, overrides={**opts.overrides, SIGNING_PARAMETER: self._signing_secret()})
        self.provisioned = self._provision()
        self._register_outputs(self.provisioned)
        local_recipe.set_local(self.provisioned.outputs,
                               local_recipe.combined(local_recipe.file_changes(opts.root, opts.config_env), opts.recipe))
        self.sagemaker = LocalSageMaker(Settings(state_dir=opts.state_dir / "sagemaker", region=opts.region,
                                                 account_id=MOTO_ACCOUNT, cwd=opts.root))
        self.sagemaker.start(port=_port_or_free(opts.sagemaker_port))
        self._set_env(self.sagemaker.client_environment())
        self.alarms = AlarmEvaluator(region=opts.region, interval_seconds=opts.alarm_evaluation_seconds).start()
        self._write_state()
        for logical_id in sorted({s.function for s in self.provisioned.sources}):
            for instance in range(instances(self.provisioned, logical_id, opts.concurrency)):
                self.workers[worker_name(logical_id, instance)] = self._start_worker(logical_id, instance)
        return self

    def stop(self) -> None:
        for process in self.workers.values():
            process.terminate()
        for process in self.workers.values():
            _wait_or_kill(process, 15)
        self.workers.clear()
        if self.alarms is not None:
            self.alarms.stop()
            self.alarms = None
        if self.sagemaker is not None:
            self.sagemaker.close(grace_seconds=10)
            self.sagemaker = None
        if self.moto is not None:
            self.moto.terminate()
            _wait_or_kill(self.moto, 10)
            self.moto = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        _forget_sessions()

    def __enter__(self) -> "LocalStack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check(self) -> None:
        """Raise if a part of the stack died (a demo should stop, not hang)."""
        processes = {"moto": self.moto, **self.workers}
        for name, process in processes.items():
            if process is not None and process.poll() is not None:
                raise StackError(f"{name} exited with code {process.returncode}; see {self.log_path(name)}")

    def log_path(self, name: str) -> Path:
        return self.options.state_dir / "logs" / f"{name}.log"

    @property
    def outputs(self) -> dict[str, str]:
        assert self.provisioned is not None
        return self.provisioned.outputs

    # --- parts ----------------------------------------------------------------------------------
    def _start_moto(self) -> str:
        port = _port_or_free(self.options.moto_port)
        self.moto = subprocess.Popen(
            [sys.executable, "-m", "atelier.local.moto_server", "127.0.0.1", str(port)],
            stdout=self.log_path("moto").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait_for_http(f"{url}/moto-api/", self.moto, timeout_s=60)
        return url

    def _upload_base(self, folder: Path) -> str:
        """The base into a bucket of its own (the stack's buckets do not exist yet): its URI."""
        from atelier import bases
        if "PretrainedModelUri" in self.options.overrides:
            raise StackError("give a base either as --base or as --parameter PretrainedModelUri=..., not both")
        boto3.client("s3", region_name=self.options.region).create_bucket(Bucket=LOCAL_BASES_BUCKET)
        return bases.add(LOCAL_BASES_BUCKET, folder, folder.resolve().name).uri

    def _signing_secret(self) -> str:
        """A new local signing identity in a secret (the stack's template takes it as AWS's would): its ARN."""
        from atelier.local import signing
        if SIGNING_PARAMETER in self.options.overrides:
            raise StackError(f"give a signing secret either as --sign or as --parameter {SIGNING_PARAMETER}=..., not both")
        identity = signing.local_identity()
        (self.options.state_dir / signing.ROOT_FILE).write_bytes(identity.root)
        secretsmanager = boto3.client("secretsmanager", region_name=self.options.region)
        return signing.create_secret(secretsmanager, f"{self.options.stack}/c2pa-signing", identity)

    def _provision(self) -> Provisioned:
        opts = self.options
        overrides = {**load_overrides(opts.root / "samconfig.toml", opts.config_env), **opts.overrides}
        expanded = expand(opts.root / "template.yaml", overrides, opts.stack, opts.region, MOTO_ACCOUNT)
        set_environment(expanded, {**load_tuning(opts.root, opts.config_env), **opts.environment})
        for logical, properties in opts.property_overrides.items():  # e.g. small Timeouts in the chaos test
            expanded.resources[logical].setdefault("Properties", {}).update(properties)
        session = boto3.session.Session(region_name=opts.region)
        provisioned = Provisioner(expanded, opts.stack, opts.region, MOTO_ACCOUNT, session.client).provision()
        for logical, why in provisioned.skipped.items():
            log.info("not created locally: %s (%s)", logical, why)
        return provisioned

    def _register_outputs(self, provisioned: Provisioned) -> None:
        register_outputs(self.options.stack, provisioned.outputs)

    def _start_worker(self, logical_id: str, instance: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "atelier.local.worker", str(self.options.state_file), logical_id, str(instance)],
            stdout=self.log_path(worker_name(logical_id, instance)).open("wb"), stderr=subprocess.STDOUT,
            cwd=self.options.root, env={**os.environ, "PYTHONUNBUFFERED": "1", **self._worker_options()},
            start_new_session=True)

    def _worker_options(self) -> dict[str, str]:
        """The opt-in worker settings, as environment variables (none by default)."""
        options = {}
        if self.options.schedule_scale != 1.0:
            options[SCHEDULE_SCALE_ENV] = str(self.options.schedule_scale)
        if self.options.chaos_file is not None:
            options[CHAOS_ENV] = str(self.options.chaos_file)
        return options

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        self.env.update(values)
        _forget_sessions()

    def _write_state(self) -> None:
        assert self.provisioned is not None
        state = {"env": self.env, "provisioned": self.provisioned.to_json(), "pid": os.getpid()}
        self.options.state_file.write_text(json.dumps(state, indent=1))


def register_outputs(stack: str, outputs: dict[str, str]) -> None:
    """A CloudFormation stack that holds only the outputs, so tools read them as on AWS."""
    template = {"Resources": OUTPUTS_TEMPLATE_RESOURCE, "Outputs": {k: {"Value": v} for k, v in outputs.items()}}
    boto3.client("cloudformation").create_stack(StackName=stack, TemplateBody=json.dumps(template))


def instances(provisioned: Provisioned, logical_id: str, local_cap: int) -> int:
    """How many worker processes run a function: one for a function only EventBridge rules invoke
    (rare events); for SQS mappings, as many as Lambda would run at most, capped at `local_cap`."""
    sources = [s for s in provisioned.sources if s.function == logical_id]
    if not any(s.kind == "sqs" for s in sources):
        return 1
    caps = [local_cap, *(s.max_concurrency for s in sources if s.kind == "sqs" and s.max_concurrency)]
    reserved = provisioned.functions[logical_id].reserved_concurrency
    if reserved is not None:
        caps.append(reserved)
    return min(caps)


def worker_name(logical_id: str, instance: int) -> str:
    """The process's name in `workers` and its log: the function's own for the first."""
    return logical_id if instance == 0 else f"{logical_id}-{instance + 1}"


def _forget_sessions() -> None:
    """Clients made before the environment changed keep its old credentials and endpoint (boto3's
    default session, core.aws's cached clients): the next ones read the stack's."""
    boto3.DEFAULT_SESSION = None
    aws = sys.modules.get("core.aws")
    if aws is not None:
        aws.reset_clients()


def _port_or_free(port: int) -> int:
    """The requested port, or any free one for 0 (tests run several stacks)."""
    if port:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise StackError(f"port {port} is in use: is another `atelier local up` running?")
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_http(url: str, process: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"{process.args} exited with code {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise StackError(f"{url} did not answer within {timeout_s:.0f} s")


def _wait_or_kill(process: subprocess.Popen[Any], timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
