"""atelier.local.template: intrinsic functions, creation order and parameter overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import IMAGES
from atelier.local.recipe import file_changes
from atelier.local.template import Resolver, TemplateError, creation_order, dependencies, expand, load_overrides

REPO = Path(__file__).resolve().parents[2]
PARAMETERS = {"Env": "prod", "Names": "a,b,c", "Empty": "", "AWS::Region": "us-east-1",
              "AWS::AccountId": "123456789012", "AWS::StackName": "atelier"}
CONDITIONS = {
    "IsProd": {"Fn::Equals": [{"Ref": "Env"}, "prod"]},
    "IsDev": {"Fn::Equals": [{"Ref": "Env"}, "dev"]},
    "HasEmpty": {"Fn::Not": [{"Fn::Equals": [{"Ref": "Empty"}, ""]}]},
    "ProdAndNotDev": {"Fn::And": [{"Condition": "IsProd"}, {"Fn::Not": [{"Condition": "IsDev"}]}]},
}
PHYSICAL = {"Queue": "https://sqs.us-east-1.amazonaws.com/123456789012/atelier-Queue", "Bucket": "atelier-bucket"}
ATTRIBUTES = {("Queue", "Arn"): "arn:aws:sqs:us-east-1:123456789012:atelier-Queue",
              ("Queue", "QueueName"): "atelier-Queue", ("Bucket", "Arn"): "arn:aws:s3:::atelier-bucket"}


@pytest.fixture
def resolver() -> Resolver:
    return Resolver(PARAMETERS, CONDITIONS, ref=PHYSICAL.__getitem__,
                    get_att=lambda logical, attribute: ATTRIBUTES[(logical, attribute)])


# --- Ref, GetAtt ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value"), [
    pytest.param("Env", "prod", id="parameter"),
    pytest.param("AWS::Region", "us-east-1", id="pseudo-parameter"),
    pytest.param("Queue", PHYSICAL["Queue"], id="resource"),
])
def test_ref(resolver: Resolver, name: str, value: str) -> None:
    assert resolver.resolve({"Ref": name}) == value


@pytest.mark.parametrize("arg", [pytest.param("Queue.Arn", id="string"), pytest.param(["Queue", "Arn"], id="list")])
def test_get_att(resolver: Resolver, arg: Any) -> None:
    assert resolver.resolve({"Fn::GetAtt": arg}) == ATTRIBUTES[("Queue", "Arn")]


def test_get_att_attribute_may_be_a_ref(resolver: Resolver) -> None:
    resolver.parameters = {**PARAMETERS, "Attribute": "QueueName"}

    assert resolver.resolve({"Fn::GetAtt": ["Queue", {"Ref": "Attribute"}]}) == "atelier-Queue"


# --- FindInMap -------------------------------------------------------------------------------------

def test_find_in_map_looks_up_with_resolved_keys(resolver: Resolver) -> None:
    resolver.mappings = {"Sizes": {"prod": {"Count": 8}, "dev": {"Count": 1}}}
    assert resolver.resolve({"Fn::FindInMap": ["Sizes", {"Ref": "Env"}, "Count"]}) == 8


def test_find_in_map_without_the_key_fails_as_cloudformation_does(resolver: Resolver) -> None:
    resolver.mappings = {"Sizes": {"dev": {"Count": 1}}}
    with pytest.raises(TemplateError, match="Sizes has no prod.Count"):
        resolver.resolve({"Fn::FindInMap": ["Sizes", {"Ref": "Env"}, "Count"]})


# --- Sub ----------------------------------------------------------------------------------------

def test_sub_replaces_parameters_pseudo_parameters_and_resources(resolver: Resolver) -> None:
    text = "${AWS::StackName}-${Env}-${AWS::AccountId}-${Bucket}"

    assert resolver.resolve({"Fn::Sub": text}) == "atelier-prod-123456789012-atelier-bucket"


def test_sub_replaces_resource_attributes(resolver: Resolver) -> None:
    assert resolver.resolve({"Fn::Sub": "${Bucket.Arn}/*"}) == "arn:aws:s3:::atelier-bucket/*"


def test_sub_keeps_escaped_literals(resolver: Resolver) -> None:
    assert resolver.resolve({"Fn::Sub": "${!Literal}-${Env}-${!Bucket.Arn}"}) == "${Literal}-prod-${Bucket.Arn}"


def test_sub_with_variables(resolver: Resolver) -> None:
    arg = ["${Name}:${Env}:${Arn}:${Queue.QueueName}", {"Name": "x", "Arn": {"Fn::GetAtt": ["Queue", "Arn"]}}]

    assert resolver.resolve({"Fn::Sub": arg}) == f"x:prod:{ATTRIBUTES[('Queue', 'Arn')]}:atelier-Queue"


def test_sub_variables_shadow_parameters(resolver: Resolver) -> None:
    assert resolver.resolve({"Fn::Sub": ["${Env}", {"Env": "staging"}]}) == "staging"


# --- Join, Select, Split ------------------------------------------------------------------------

def test_join_resolves_its_delimiter_and_items(resolver: Resolver) -> None:
    arg = [":", ["arn", {"Ref": "AWS::Region"}, {"Fn::GetAtt": "Queue.QueueName"}, 7]]

    assert resolver.resolve({"Fn::Join": arg}) == "arn:us-east-1:atelier-Queue:7"


def test_join_of_a_resolved_list(resolver: Resolver) -> None:
    assert resolver.resolve({"Fn::Join": ["-", {"Fn::Split": [",", {"Ref": "Names"}]}]}) == "a-b-c"


@pytest.mark.parametrize(("index", "value"), [(0, "a"), ("2", "c")])
def test_select_picks_by_index(resolver: Resolver, index: Any, value: str) -> None:
    assert resolver.resolve({"Fn::Select": [index, {"Fn::Split": [",", {"Ref": "Names"}]}]}) == value


def test_select_from_a_literal_list(resolver: Resolver) -> None:
    assert resolver.resolve({"Fn::Select": [1, ["x", {"Ref": "Env"}, "z"]]}) == "prod"


# --- conditions and AWS::NoValue ------------------------------------------------------------------

@pytest.mark.parametrize(("condition", "value"), [
    ("IsProd", "yes"), ("IsDev", "no"), ("HasEmpty", "no"), ("ProdAndNotDev", "yes"),
])
def test_if_follows_the_condition(resolver: Resolver, condition: str, value: str) -> None:
    assert resolver.resolve({"Fn::If": [condition, "yes", "no"]}) == value


def test_if_resolves_only_the_branch_taken(resolver: Resolver) -> None:
    # the other branch names a resource that does not exist
    assert resolver.resolve({"Fn::If": ["IsProd", {"Ref": "Env"}, {"Ref": "Missing"}]}) == "prod"


def test_unknown_condition_is_a_template_error(resolver: Resolver) -> None:
    with pytest.raises(TemplateError, match="Nope"):
        resolver.resolve({"Fn::If": ["Nope", "a", "b"]})


def test_no_value_removes_the_key(resolver: Resolver) -> None:
    props = {"Keep": {"Ref": "Env"}, "Drop": {"Ref": "AWS::NoValue"}}

    assert resolver.resolve(props) == {"Keep": "prod"}


def test_if_to_no_value_removes_the_key(resolver: Resolver) -> None:
    variables = {"A": "1", "LOCAL": {"Fn::If": ["IsDev", "http://localhost", {"Ref": "AWS::NoValue"}]},
                 "PROD": {"Fn::If": ["IsProd", {"Ref": "Env"}, {"Ref": "AWS::NoValue"}]}}

    assert resolver.resolve({"Variables": variables}) == {"Variables": {"A": "1", "PROD": "prod"}}


def test_no_value_removes_a_list_item(resolver: Resolver) -> None:
    items = ["a", {"Fn::If": ["IsDev", "b", {"Ref": "AWS::NoValue"}]}, {"Ref": "AWS::NoValue"}, "c"]

    assert resolver.resolve(items) == ["a", "c"]


def test_nested_structures_are_resolved_everywhere(resolver: Resolver) -> None:
    props = {"Policy": {"Statement": [{"Effect": "Allow", "Resource": [{"Fn::GetAtt": "Bucket.Arn"},
                                                                        {"Fn::Sub": "${Bucket.Arn}/*"}]}]}}

    assert resolver.resolve(props) == {"Policy": {"Statement": [{"Effect": "Allow", "Resource": [
        "arn:aws:s3:::atelier-bucket", "arn:aws:s3:::atelier-bucket/*"]}]}}


# --- dependencies and creation_order ------------------------------------------------------------

def test_dependencies_come_from_ref_get_att_sub_and_depends_on() -> None:
    resource = {"DependsOn": ["Explicit"], "Properties": {
        "A": {"Ref": "ByRef"}, "B": {"Fn::GetAtt": "ByGetAtt.Arn"}, "C": [{"Fn::GetAtt": ["ByList", "Arn"]}],
        "D": {"Fn::Sub": "${BySub.Arn}/${BySubRef}-${!NotADependency}"},
        "E": {"Fn::Sub": ["${Var}", {"Var": {"Ref": "InSubVars"}}]},
    }}

    # `Var` (a Sub variable) may be listed too: creation_order keeps only names that are resources
    assert dependencies(resource) - {"Var"} == {"Explicit", "ByRef", "ByGetAtt", "ByList", "BySub", "BySubRef",
                                                 "InSubVars"}


def test_creation_order_puts_dependencies_first() -> None:
    resources = {
        "Alpha": {"Properties": {"Target": {"Fn::GetAtt": ["Zulu", "Arn"]}}},
        "Mike": {"Properties": {"Name": {"Fn::Sub": "${Alpha}-${AWS::Region}"}}},
        "Zulu": {"DependsOn": "Yankee", "Properties": {"Env": {"Ref": "SomeParameter"}}},
        "Yankee": {},
    }

    assert creation_order(resources) == ["Yankee", "Zulu", "Alpha", "Mike"]


def test_creation_order_of_the_template_has_every_resource_after_its_dependencies() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        resources = expand(REPO / "template.yaml", IMAGES, "atelier", "us-east-1", "123456789012").resources

    order = creation_order(resources)

    assert sorted(order) == sorted(resources)
    position = {name: i for i, name in enumerate(order)}
    assert [(name, dep) for name in resources for dep in dependencies(resources[name]) & resources.keys()
            if position[dep] > position[name]] == []


def test_creation_order_rejects_a_cycle() -> None:
    resources = {"A": {"Properties": {"X": {"Ref": "B"}}}, "B": {"Properties": {"Y": {"Fn::GetAtt": "C.Arn"}}},
                 "C": {"DependsOn": "A"}, "D": {}}

    with pytest.raises(TemplateError, match="circular dependency: A -> B -> C -> A"):
        creation_order(resources)


# --- parameter overrides ------------------------------------------------------------------------

def test_load_overrides_reads_the_list_form_of_the_real_samconfig() -> None:
    overrides = load_overrides(REPO / "samconfig.toml", "local")

    assert {k: overrides[k] for k in ("TrainingQuota", "TrainingInstanceType", "EndpointInstanceType")} \
        == {"TrainingQuota": "9", "TrainingInstanceType": "ml.m5.xlarge", "EndpointInstanceType": "ml.m5.large"}
    # what the local jobs train is the local recipe's (recipes/local.toml), no longer a parameter
    assert file_changes(REPO, "local")["training"]["hyperparameters"]["model-config"] == "demo"
    assert "TrainingHyperparameters" not in overrides


def test_real_local_overrides_name_only_template_parameters() -> None:
    overrides = load_overrides(REPO / "samconfig.toml", "local")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        expanded = expand(REPO / "template.yaml", {**IMAGES, **overrides}, "atelier", "us-east-1", "123456789012")

    assert {k: expanded.parameters[k] for k in overrides} == overrides


def test_load_overrides_reads_the_string_form(tmp_path: Path) -> None:
    samconfig = tmp_path / "samconfig.toml"
    samconfig.write_text('version = 0.1\n[local.deploy.parameters]\nparameter_overrides = \'A=1 B="x y" C=s3://b/k\'\n')

    assert load_overrides(samconfig, "local") == {"A": "1", "B": "x y", "C": "s3://b/k"}


def test_load_overrides_list_items_may_quote_their_values(tmp_path: Path) -> None:
    samconfig = tmp_path / "samconfig.toml"
    samconfig.write_text('[local.deploy.parameters]\nparameter_overrides = ["A=1", "B=\\"x y\\"", "C=k=v"]\n')

    assert load_overrides(samconfig, "local") == {"A": "1", "B": "x y", "C": "k=v"}


def test_load_overrides_of_a_missing_environment_or_file_is_empty(tmp_path: Path) -> None:
    assert (load_overrides(REPO / "samconfig.toml", "nope"), load_overrides(tmp_path / "absent.toml", "local")) \
        == ({}, {})


def test_expand_rejects_an_override_of_an_unknown_parameter() -> None:
    with pytest.raises(TemplateError, match="NoSuchParameter"):
        expand(REPO / "template.yaml", {**IMAGES, "TrainingQuota": "2", "NoSuchParameter": "1"}, "atelier", "us-east-1",
               "123456789012")


def test_expand_refuses_a_stack_without_its_images_as_cloudformation_does() -> None:
    # no placeholder default: a stack with no image would fail at its first training job, hours later
    with pytest.raises(TemplateError, match="TrainingImageUri has no default"):
        expand(REPO / "template.yaml", {"InferenceImageUri": IMAGES["InferenceImageUri"]}, "atelier", "us-east-1",
               "123456789012")


@pytest.mark.parametrize("override, message", [
    ({"TrainingImageUri": "atelier-trainer:latest"}, "must be the ECR URI of the image built from trainer/Dockerfile"),
    ({"TrainingImageUri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/atelier-trainer"}, "with a tag or digest"),
    ({"TrainingQuota": "0"}, r"TrainingQuota=0 must be within 1\.\.None"),
    ({"TrainingQuota": "many"}, "must be a number"),
    ({"LogRetentionDays": "2"}, "must be one of"),
    ({"SweepSchedule": "cron(0 * * * ? *)"}, "must match pattern"),
])
def test_expand_checks_each_parameter_s_constraints_as_cloudformation_does(override: dict, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        expand(REPO / "template.yaml", {**IMAGES, **override}, "atelier", "us-east-1", "123456789012")


def test_expand_applies_overrides_and_pseudo_parameters() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        expanded = expand(REPO / "template.yaml", {**IMAGES, "TrainingQuota": "5"}, "stack1", "eu-west-1", "210987654321")

    assert ({k: expanded.parameters[k] for k in ("TrainingQuota", "TrainingLineage", "AWS::StackName", "AWS::Region",
                                                   "AWS::AccountId")}
            == {"TrainingQuota": "5", "TrainingLineage": "main", "AWS::StackName": "stack1",
                "AWS::Region": "eu-west-1", "AWS::AccountId": "210987654321"})
