"""template.yaml: lint-clean, and the operational rules of STYLE.md hold for every resource."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


from atelier.local.template import Resolver
from tests.unit.template_helpers import resources  # noqa: F401 (a fixture)
from tests.unit.template_helpers import (FUNCTIONS_DIR, LOCAL_ENDPOINT, REPO, expand_with, function_environments,
                                         logical_of_arn, of_type, resolve)

# --- cfn-lint -----------------------------------------------------------------------------------

def test_cfn_lint_passes() -> None:
    # `python -m cfnlint` has no __main__; run the console script's entry point in this interpreter.
    lint = subprocess.run([sys.executable, "-c", "import sys; from cfnlint.runner import main; sys.exit(main())",
                           "template.yaml"], cwd=REPO, capture_output=True, text=True, timeout=120)

    assert lint.returncode == 0, lint.stdout + lint.stderr


# --- queues and event sources -------------------------------------------------------------------

def test_the_template_has_sqs_event_sources(resources: dict[str, dict[str, Any]]) -> None:
    assert sorted(of_type(resources, "AWS::Lambda::EventSourceMapping")) == ["ImportFunctionShards",
                                                                             "IngestFunctionUploads",
                                                                             "PackFunctionSamples"]


def test_every_sqs_event_source_reports_batch_item_failures(resources: dict[str, dict[str, Any]]) -> None:
    mappings = of_type(resources, "AWS::Lambda::EventSourceMapping")

    assert {name: m.get("FunctionResponseTypes") for name, m in mappings.items()} \
        == {name: ["ReportBatchItemFailures"] for name in mappings}


def test_every_consumed_queue_redrives_after_at_least_five_receives(resources: dict[str, dict[str, Any]]) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    for name, mapping in of_type(resources, "AWS::Lambda::EventSourceMapping").items():
        queue = queues[logical_of_arn(mapping["EventSourceArn"])]
        redrive = queue.get("RedrivePolicy", {})
        assert int(redrive.get("maxReceiveCount", 0)) >= 5, name
        assert logical_of_arn(redrive["deadLetterTargetArn"]) in queues, name


def test_every_consumed_queue_hides_messages_for_six_times_the_consumer_timeout(
        resources: dict[str, dict[str, Any]]) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    functions = of_type(resources, "AWS::Lambda::Function")
    for name, mapping in of_type(resources, "AWS::Lambda::EventSourceMapping").items():
        queue = queues[logical_of_arn(mapping["EventSourceArn"])]
        timeout = int(functions[mapping["FunctionName"]]["Timeout"])
        assert int(queue.get("VisibilityTimeout", 30)) >= 6 * timeout, (name, queue.get("VisibilityTimeout"), timeout)


def dead_letter_targets(resources: dict[str, dict[str, Any]]) -> set[str]:
    """Queues named as a dead-letter target by a queue, a function or a rule target."""
    targets = {logical_of_arn(q["RedrivePolicy"]["deadLetterTargetArn"])
               for q in of_type(resources, "AWS::SQS::Queue").values() if "RedrivePolicy" in q}
    targets |= {logical_of_arn(f["DeadLetterConfig"]["TargetArn"])
                for f in of_type(resources, "AWS::Lambda::Function").values() if "DeadLetterConfig" in f}
    targets |= {logical_of_arn(t["DeadLetterConfig"]["Arn"])
                for rule in of_type(resources, "AWS::Events::Rule").values()
                for t in rule.get("Targets", []) if "DeadLetterConfig" in t}
    return targets


def test_every_queue_that_is_not_a_dead_letter_queue_has_one(resources: dict[str, dict[str, Any]]) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    targets = dead_letter_targets(resources)

    assert sorted(name for name, q in queues.items() if name not in targets and "RedrivePolicy" not in q) == []
    assert targets <= queues.keys()


# --- buckets ------------------------------------------------------------------------------------

def test_every_bucket_is_encrypted(resources: dict[str, dict[str, Any]]) -> None:
    buckets = of_type(resources, "AWS::S3::Bucket")

    assert {name: [r["ServerSideEncryptionByDefault"]["SSEAlgorithm"]
                   for r in b.get("BucketEncryption", {}).get("ServerSideEncryptionConfiguration", [{}])
                   if "ServerSideEncryptionByDefault" in r]
            for name, b in buckets.items()} == {name: ["AES256"] for name in buckets}


def test_every_bucket_blocks_all_public_access(resources: dict[str, dict[str, Any]]) -> None:
    buckets = of_type(resources, "AWS::S3::Bucket")
    flags = {"BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True}

    assert {name: b.get("PublicAccessBlockConfiguration") for name, b in buckets.items()} \
        == {name: flags for name in buckets}


def denies_plain_http(statement: dict[str, Any], bucket: str) -> bool:
    resource = statement.get("Resource", [])
    resources = {resource} if isinstance(resource, str) else set(resource)
    return (statement.get("Effect") == "Deny" and statement.get("Principal") in ("*", {"AWS": "*"})
            and statement.get("Action") in ("s3:*", ["s3:*"])
            and str(statement.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport")).lower() == "false"
            and {f"{bucket}.Arn", f"{bucket}.Arn/*"} <= resources)


def test_every_bucket_policy_denies_requests_without_tls(resources: dict[str, dict[str, Any]]) -> None:
    policies = of_type(resources, "AWS::S3::BucketPolicy").values()
    tls_only = {p["Bucket"] for p in policies
                if any(denies_plain_http(s, p["Bucket"]) for s in p["PolicyDocument"]["Statement"])}

    assert tls_only == set(of_type(resources, "AWS::S3::Bucket"))


# --- functions ----------------------------------------------------------------------------------

def test_every_function_has_a_log_group_with_retention(resources: dict[str, dict[str, Any]]) -> None:
    groups = {g["LogGroupName"]: g.get("RetentionInDays") for g in of_type(resources, "AWS::Logs::LogGroup").values()}
    functions = of_type(resources, "AWS::Lambda::Function")

    # "30" is LogRetentionDays' default
    assert {name: groups.get(f"/aws/lambda/{name}") for name in functions} == {name: "30" for name in functions}


def test_every_rule_target_that_is_a_function_has_a_dead_letter_queue(resources: dict[str, dict[str, Any]]) -> None:
    functions = of_type(resources, "AWS::Lambda::Function")
    lambda_targets = [(rule, t) for rule, props in of_type(resources, "AWS::Events::Rule").items()
                      for t in props.get("Targets", []) if t["Arn"].removesuffix(".Arn") in functions]

    # Shard Sealed, job finished, `atelier lineage resume` and the backoff's schedule (start-training);
    # job state changes, model artefacts, endpoint state changes, `atelier evaluate` and `atelier rollback`
    # requests (deploy); the pack seal timer; the sweep's and the redriver's schedules
    assert sorted(rule for rule, _ in lambda_targets) == [
        "DeployFunctionEndpointStateChange", "DeployFunctionEvaluateRequest", "DeployFunctionModelArtefactCreated",
        "DeployFunctionRollbackRequest", "DeployFunctionTrainingJobStateChange",
        "PackFunctionSealTimer", "RedriveFunctionSchedule", "StartTrainingFunctionJobFinished", "StartTrainingFunctionLineageResumed",
        "StartTrainingFunctionRetryAfterBackoff", "StartTrainingFunctionShardSealed", "SweepFunctionSchedule"]
    assert [rule for rule, t in lambda_targets if "Arn" not in t.get("DeadLetterConfig", {})] == []



def test_functions_get_no_endpoint_override_by_default(resources: dict[str, dict[str, Any]]) -> None:
    environments = function_environments(resources)

    assert sorted(environments) == ["DeployFunction", "ImportFunction", "IngestFunction", "PackFunction",
                                    "RedriveFunction", "StartTrainingFunction", "SweepFunction"]
    assert {name: sorted(k for k in env if k.startswith("AWS_ENDPOINT_URL")) for name, env in environments.items()} \
        == {name: [] for name in environments}


def test_functions_get_the_local_endpoint_when_it_is_overridden() -> None:
    environments = function_environments(resolve(expand_with({"LocalEndpointUrl": LOCAL_ENDPOINT})))

    assert {name: (env.get("AWS_ENDPOINT_URL"), env.get("AWS_ENDPOINT_URL_SAGEMAKER"))
            for name, env in environments.items()} == {name: (LOCAL_ENDPOINT, None) for name in environments}


def test_env_json_gives_every_function_the_local_stack_name_of_each_resource_it_is_given(stack) -> None:
    # GIVEN, per function, the variables the template derives from a resource: `sam local invoke`
    # resolves parameters itself (samconfig.toml [local]) but cannot know the local stack's names
    expanded = expand_with({"LocalEndpointUrl": LOCAL_ENDPOINT})  # as `--config-env local` expands it
    unknown = "<a resource>"
    resolver = Resolver(expanded.parameters, expanded.conditions, mappings=expanded.mappings, ref=lambda name: unknown,
                        get_att=lambda name, attribute: unknown)
    declared = {name: resolver.resolve(f["Properties"]["Environment"]["Variables"])
                for name, f in expanded.resources.items() if f["Type"] == "AWS::Lambda::Function"}
    needed = {name: sorted(k for k, v in env.items() if unknown in str(v)) for name, env in declared.items()}
    env_json = json.loads((REPO / "events" / "env.json").read_text())
    # THEN env.json has every function, each with every such variable and none the template does not declare
    assert sorted(env_json) == sorted(declared)
    assert {name: sorted(set(needed[name]) - set(env_json[name])) for name in declared} == {n: [] for n in declared}
    assert {name: sorted(set(env_json[name]) - set(declared[name])) for name in declared} == {n: [] for n in declared}
    # AND the values are the names the local stack's provisioner gives them (queue URLs seen from Docker)
    def local(value: str) -> str:
        return urlparse(value).path if value.startswith(("http://", "https://")) else value
    assert {name: {k: local(v) for k, v in env_json[name].items()} for name in declared} == {
        name: {k: local(stack.functions[name].environment[k]) for k in env_json[name]} for name in declared}


# --- what the Lambda code depends on --------------------------------------------------------------

def requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[\[<>=!~;@ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_function_requirements_are_powertools_pillow_and_pydantic_s_floor() -> None:
    # pydantic comes with powertools[parser]; it is named only for the floor contracts.messages needs (exclude_if)
    assert requirement_names(FUNCTIONS_DIR / "layer" / "requirements.txt") == {"aws-lambda-powertools", "pillow", "pydantic"}


def imported_top_level_modules() -> dict[str, set[str]]:
    """Top-level module names each file under functions/ imports (absolute imports only)."""
    imports: dict[str, set[str]] = {}
    for path in sorted(FUNCTIONS_DIR.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        imports[str(path.relative_to(REPO))] = names
    return imports


def test_function_code_imports_no_training_libraries() -> None:
    heavy = {"torch", "diffusers", "webdataset", "transformers"}
    imports = imported_top_level_modules()

    assert len(imports) >= 10
    assert {path: names & heavy for path, names in imports.items() if names & heavy} == {}


def test_function_code_imports_only_the_lambda_runtime_and_its_requirements() -> None:
    local = {p.name for p in FUNCTIONS_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    allowed = set(sys.stdlib_module_names) | local | {
        "boto3", "botocore",  # in the Lambda runtime
        "aws_lambda_powertools", "pydantic", "pydantic_core",  # aws-lambda-powertools[parser]; pydantic's core
        "PIL",  # pillow
    }

    assert {path: sorted(names - allowed) for path, names in imported_top_level_modules().items()
            if names - allowed} == {}



def test_the_data_bucket_expires_orphan_segments_and_aborts_stale_uploads(stack) -> None:
    import boto3
    rules = boto3.client("s3").get_bucket_lifecycle_configuration(Bucket=stack.outputs["DataBucketName"])["Rules"]
    assert {r["ID"]: (r["Filter"].get("Prefix"), r.get("Expiration", {}).get("Days"),
                      r.get("AbortIncompleteMultipartUpload", {}).get("DaysAfterInitiation")) for r in rules} == {
        "OrphanSegments": ("segments/", 7, None), "IncompleteUploads": ("", None, 2)}


