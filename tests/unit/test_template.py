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


def function_environments(resources: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: f["Environment"]["Variables"] for name, f in of_type(resources, "AWS::Lambda::Function").items()}


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


# --- KMS ----------------------------------------------------------------------------------------

def role_actions_on(resources: dict[str, dict[str, Any]], role: str, resource: str) -> set[str]:
    """The actions a role's inline policies allow on one resource."""
    allowed: set[str] = set()
    for policy in resources[role]["Properties"].get("Policies", []):
        for statement in policy["PolicyDocument"]["Statement"]:
            targets = statement.get("Resource", [])
            targets = targets if isinstance(targets, list) else [targets]
            if statement.get("Effect") == "Allow" and resource in targets:
                actions = statement["Action"]
                allowed |= set(actions if isinstance(actions, list) else [actions])
    return allowed


def test_the_deploy_function_may_use_the_training_key_only_when_one_is_given() -> None:
    key = "arn:aws:kms:us-east-1:123456789012:key/training"
    with_key = resolve(expand_with({"TrainingKmsKeyArn": key}))
    # it reads outputs the training key encrypted and names the key in endpoint configs
    assert {"kms:Decrypt", "kms:CreateGrant"} <= role_actions_on(with_key, "DeployFunctionRole", key)
    without = resolve(expand_with({}))
    statements = [st for policy in without["DeployFunctionRole"]["Properties"].get("Policies", [])
                  for st in policy["PolicyDocument"]["Statement"]]
    assert statements and not any("kms:CreateGrant" in json.dumps(st) for st in statements)


def test_the_deploy_function_may_read_the_tags_of_the_pipeline_s_training_jobs_and_of_nothing_else(
        resources: dict[str, dict[str, Any]]) -> None:
    # a job state change without tags is told by DescribeTrainingJob's ARN and ListTags (core.deploy.candidates)
    jobs = "arn:aws:sagemaker:us-east-1:123456789012:training-job/atelier-*"
    assert {"sagemaker:DescribeTrainingJob", "sagemaker:ListTags"} <= role_actions_on(resources, "DeployFunctionRole", jobs)
    listed = [st["Resource"] for policy in resources["DeployFunctionRole"]["Properties"]["Policies"]
              for st in policy["PolicyDocument"]["Statement"] if "sagemaker:ListTags" in st.get("Action", [])]
    assert listed == [jobs]


# --- the C2PA signing secret (docs/provenance.md) ----------------------------------------------------

SIGNING_SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:atelier/c2pa-signing-AbCdEf"


def secret_grants(resources: dict[str, dict[str, Any]]) -> dict[str, list[tuple[Any, Any]]]:
    """Every role's Secrets Manager statements: (actions, resources)."""
    return {logical: found for logical, resource in resources.items() if resource["Type"] == "AWS::IAM::Role"
            if (found := [(st["Action"], st.get("Resource"))
                          for policy in resource["Properties"].get("Policies", [])
                          for st in policy["PolicyDocument"]["Statement"] if "secretsmanager:" in json.dumps(st)])}


def test_only_the_sagemaker_role_may_read_the_signing_secret_and_only_when_one_is_given() -> None:
    signing = resolve(expand_with({"C2paSigningSecretArn": SIGNING_SECRET}))

    assert secret_grants(signing) == {"SageMakerRole": [("secretsmanager:GetSecretValue", SIGNING_SECRET)]}
    assert function_environments(signing)["DeployFunction"]["C2PA_SIGNING_SECRET_ARN"] == SIGNING_SECRET
    assert secret_grants(resolve(expand_with({}))) == {}


# --- the base (PretrainedModelUri) ---------------------------------------------------------------

BASE_URIS = ["s3://my-models/bases/sd2/", "s3://my-models/sd2/model.tar.gz", "s3://my-models/model.tar.gz",
             "s3://my-models/bases/sd2", "s3://my-models/bases/sd2/weights.tar.gz", "s3://my-models/",
             "s3://My_Models/sd2/", "s3://my-models/bases/*/", "s3://my-models/a b/", "s3://my-models/a//b/",
             "https://my-models/sd2/", ""]


@pytest.mark.parametrize("uri", BASE_URIS)
def test_the_parameter_accepts_exactly_the_bases_the_settings_accept(uri: str) -> None:
    from samtranslator.yaml_helper import yaml_parse

    from core.start_training.pretrained import check_uri
    pattern = yaml_parse((REPO / "template.yaml").read_text())["Parameters"]["PretrainedModelUri"]["AllowedPattern"]
    try:
        accepted = check_uri(uri) == uri
    except ValueError:
        accepted = uri == ""  # empty: no base

    assert (re.fullmatch(pattern, uri) is not None) == accepted


def s3_resources_outside_the_stack(resources: dict[str, dict[str, Any]], role: str) -> list[str]:
    """S3 ARNs a role's policies name that are none of the template's buckets (which resolve to
    `<Bucket>.Arn`, or to `arn:aws:s3:::<Bucket>` in SAM policy templates)."""
    buckets = set(of_type(resources, "AWS::S3::Bucket"))
    found = []
    for policy in resources[role]["Properties"].get("Policies", []):
        for statement in policy["PolicyDocument"]["Statement"]:
            targets = statement.get("Resource", [])
            found += [t for t in (targets if isinstance(targets, list) else [targets]) if str(t).startswith("arn:aws:s3:::")
                      and str(t).removeprefix("arn:aws:s3:::").split("/")[0] not in buckets]
    return sorted(found)


@pytest.mark.parametrize("role", ["StartTrainingFunctionRole", "SageMakerRole"])
def test_the_function_and_sagemaker_may_read_the_base_only_when_one_is_given(role: str) -> None:
    with_base = resolve(expand_with({"PretrainedModelUri": "s3://partner-models/bases/sd2/"}))

    # GetObject under the base's prefix only; the bucket's listing (no s3:prefix condition can be built)
    assert s3_resources_outside_the_stack(with_base, role) == ["arn:aws:s3:::partner-models",
                                                               "arn:aws:s3:::partner-models/bases/sd2/*"]
    assert role_actions_on(with_base, role, "arn:aws:s3:::partner-models/bases/sd2/*") == {"s3:GetObject", "s3:ListBucket"}
    assert s3_resources_outside_the_stack(resolve(expand_with({})), role) == []


def test_a_model_tar_gz_base_is_readable_as_that_key() -> None:
    with_base = resolve(expand_with({"PretrainedModelUri": "s3://partner-models/sd2/model.tar.gz"}))

    assert s3_resources_outside_the_stack(with_base, "SageMakerRole") == ["arn:aws:s3:::partner-models",
                                                               "arn:aws:s3:::partner-models/sd2/model.tar.gz*"]


def test_the_start_training_function_gets_the_base_and_the_autoencoder_settings(
        resources: dict[str, dict[str, Any]]) -> None:
    env = function_environments(resources)["StartTrainingFunction"]

    assert {k: env[k] for k in ("TRAINING_PRETRAINED_MODEL_URI", "TRAINING_AUTOENCODER_INSTANCE_TYPE",
                                "TRAINING_AUTOENCODER_HYPERPARAMETERS", "TRAINING_EVAL_DATA_URI")} == {
        "TRAINING_PRETRAINED_MODEL_URI": "", "TRAINING_AUTOENCODER_INSTANCE_TYPE": "ml.g5.2xlarge",
        "TRAINING_AUTOENCODER_HYPERPARAMETERS": '{"steps": "20000", "batch-size": "32", "learning-rate": "0.0001"}',
        "TRAINING_EVAL_DATA_URI": "s3://DataBucket/eval/"}


# --- KMS: what AWS asks of a role that writes to a bucket encrypted with the storage key -------------

STORAGE_KEY = "arn:aws:kms:us-east-1:123456789012:key/storage"


def roles_that_put_objects(resources: dict[str, dict[str, Any]]) -> list[str]:
    return [logical for logical, resource in resources.items() if resource["Type"] == "AWS::IAM::Role"
            and any("s3:PutObject" in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])
                    for policy in resource["Properties"].get("Policies", [])
                    for st in policy["PolicyDocument"]["Statement"] if st.get("Effect") == "Allow")]


def test_every_role_that_writes_objects_may_make_and_read_data_keys_of_the_storage_key() -> None:
    # S3: a PUT to an SSE-KMS bucket needs kms:GenerateDataKey; a multipart upload (boto3 switches to
    # one above 8 MiB, and partners' tools do) also needs kms:Decrypt to assemble the parts.
    # Source: the S3 User Guide, "Protecting data with server-side encryption using AWS KMS keys".
    # (Partner roles are made by the CLI: tests/unit/test_partner_policies.py checks theirs.)
    keyed = resolve(expand_with({"StorageKmsKeyArn": STORAGE_KEY}))
    writers = roles_that_put_objects(keyed)
    assert {"SageMakerRole"} <= set(writers)
    missing = {role: {"kms:GenerateDataKey", "kms:Decrypt"} - role_actions_on(keyed, role, STORAGE_KEY)
               for role in writers}
    assert not {role: actions for role, actions in missing.items() if actions}


def test_sagemaker_may_encrypt_outputs_with_the_training_key() -> None:
    # SageMaker, OutputDataConfig.KmsKeyId: "the SageMaker execution role must include permissions to
    # call kms:Encrypt"; volumes need CreateGrant; reading the outputs back needs Decrypt.
    key = "arn:aws:kms:us-east-1:123456789012:key/training"
    keyed = resolve(expand_with({"TrainingKmsKeyArn": key}))
    assert {"kms:Encrypt", "kms:GenerateDataKey", "kms:Decrypt", "kms:CreateGrant"} <= role_actions_on(
        keyed, "SageMakerRole", key)


def test_sam_build_installs_the_function_dependencies_once_into_one_layer(resources: dict[str, dict[str, Any]]) -> None:
    # `sam build` runs pip for every function whose CodeUri holds a requirements.txt, and builds each
    # function on its own when their Metadata differ (ours do): the packages go to one layer instead
    functions = of_type(resources, "AWS::Lambda::Function")
    (layer,) = of_type(resources, "AWS::Lambda::LayerVersion")
    assert all(f.get("Layers") == [layer] for f in functions.values()), {n: f.get("Layers") for n, f in functions.items()}
    assert not (FUNCTIONS_DIR / "requirements.txt").exists()
    assert (FUNCTIONS_DIR / "layer" / "requirements.txt").is_file()


@pytest.mark.parametrize("lanes", ["1", "4", "64"])
def test_pack_lanes_reach_the_packer_and_two_packers_run_per_lane(lanes: str) -> None:
    resources = resolve(expand_with({"PackLanes": lanes}))
    pack = resources["PackFunction"]["Properties"]
    mapping = resources["PackFunctionSamples"]["Properties"]
    assert pack["Environment"]["Variables"]["PACK_LANES"] == lanes
    assert mapping["ScalingConfig"]["MaximumConcurrency"] == 2 * int(lanes)  # Lambda accepts 2..1000


def test_every_allowed_lane_count_has_a_concurrency() -> None:
    from core.pack.lanes import MAX_LANES
    expanded = expand_with({})
    from samtranslator.yaml_helper import yaml_parse
    declared = yaml_parse((REPO / "template.yaml").read_text())["Parameters"]["PackLanes"]
    allowed = [str(v) for v in declared["AllowedValues"]]
    assert set(expanded.mappings["PackLaneConcurrency"]) == set(allowed) and max(map(int, allowed)) == MAX_LANES


# --- compiled shapes shared across lineages (core/start_training/compile_caches.py) --------------------------

def test_the_start_training_function_may_publish_compiled_shapes_and_nothing_wider(
        resources: dict[str, dict[str, Any]]) -> None:
    role = "StartTrainingFunctionRole"
    # the copy: read the lineage's file (and the shared copy's metadata), write the shared one
    assert "s3:GetObject" in role_actions_on(resources, role, "ModelsBucket.Arn/checkpoints/*/compile-cache/*")
    assert "s3:GetObject" in role_actions_on(resources, role, "ModelsBucket.Arn/compile-cache/*")
    assert "s3:PutObject" in role_actions_on(resources, role, "ModelsBucket.Arn/compile-cache/*")
    assert not any("s3:PutObject" in role_actions_on(resources, role, f"ModelsBucket.Arn/{prefix}")
                   for prefix in ("*", "checkpoints/*", "checkpoints/*/compile-cache/*"))
    # the listings, by prefix only
    listing = [st for policy in resources[role]["Properties"]["Policies"] if isinstance(policy, dict)
               and "PolicyDocument" in policy for st in policy["PolicyDocument"]["Statement"]
               if st.get("Action") == "s3:ListBucket" and st.get("Resource") == "ModelsBucket.Arn"]
    assert [st["Condition"]["StringLike"]["s3:prefix"] for st in listing] == [
        ["encoded/*", "compile-cache/*", "checkpoints/*/compile-cache/*", "training/*"]]


def test_shared_compiled_shapes_expire_unless_published_again(resources: dict[str, dict[str, Any]]) -> None:
    rules = {r["Id"]: r for r in resources["ModelsBucket"]["Properties"]["LifecycleConfiguration"]["Rules"]}

    assert rules["CompileCacheExpiry"] == {"Id": "CompileCacheExpiry", "Status": "Enabled", "Prefix": "compile-cache/",
                                           "ExpirationInDays": 30, "NoncurrentVersionExpiration": {"NoncurrentDays": 1}}
