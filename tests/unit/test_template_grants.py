"""template.yaml's grants: the keys, the signing secret, the base, the layer, the pack lanes and the shared compiled
shapes each reach exactly the roles and functions that need them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.unit.template_helpers import resources  # noqa: F401 (a fixture)
from contracts.recipe_file import packaged
from tests.unit.template_helpers import FUNCTIONS_DIR, REPO, expand_with, function_environments, of_type, resolve


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
                                "TRAINING_EVAL_DATA_URI")} == {
        "TRAINING_PRETRAINED_MODEL_URI": "", "TRAINING_AUTOENCODER_INSTANCE_TYPE": "ml.g5.2xlarge",
        "TRAINING_EVAL_DATA_URI": "s3://DataBucket/eval/"}
    # the autoencoder's hyperparameters are the recipe's (contracts/default_recipe.json until one is set)
    assert packaged().settings()["TRAINING_AUTOENCODER_HYPERPARAMETERS"] \
        == '{"steps": "20000", "batch-size": "32", "learning-rate": "0.0001"}'


def test_the_functions_that_decide_with_the_recipe_read_it_and_none_writes_it(
        resources: dict[str, dict[str, Any]]) -> None:
    # the stored recipes (contracts.recipe_file.key) are written by `atelier recipe set`, under the operator's rights
    recipes = "ModelsBucket.Arn/recipes/*"
    roles = [logical for logical, r in resources.items() if r["Type"] == "AWS::IAM::Role" and logical.endswith("FunctionRole")]

    assert role_actions_on(resources, "StartTrainingFunctionRole", recipes) == {"s3:GetObject"}
    assert "s3:GetObject" in role_actions_on(resources, "DeployFunctionRole", "arn:aws:s3:::ModelsBucket/*")  # S3ReadPolicy
    assert {role: sorted(role_actions_on(resources, role, recipes) - {"s3:GetObject"}) for role in roles} \
        == {role: [] for role in roles}


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
