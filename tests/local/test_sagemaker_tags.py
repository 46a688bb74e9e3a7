"""AddTags, ListTags, DeleteTags and ListModels of the local SageMaker, through plain boto3 as the
pipeline and the CLI call them (core.aws.sagemaker_tags pages ListTags; `atelier takedown` lists models)."""

from __future__ import annotations

from typing import Any

from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    ROLE,
    aws,
    error_of,
    job_events,
    moto_url,
    overrides,
    put_model,
    put_shards,
    s3,
    service,
    sm,
    training_request,
    wait_for_job,
)

from core import aws as core_aws

JOB = "atelier-tags-0123456789abcdef"
TAGS = [{"Key": "atelier:training-job", "Value": JOB}, {"Key": "team", "Value": "ml platform"}]


def tags_of(sm: Any, arn: str) -> list[dict[str, str]]:
    return [tag for page in sm.get_paginator("list_tags").paginate(ResourceArn=arn) for tag in page["Tags"]]


def test_every_resource_kind_lists_the_tags_it_was_created_with(sm: Any, s3: Any) -> None:
    put_shards(s3, "shards/a.tar")
    job = sm.create_training_job(**training_request(JOB, Tags=TAGS))["TrainingJobArn"]
    model = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=TAGS[:1],
                            PrimaryContainer={"Image": "image"})["ModelArn"]
    config = sm.create_endpoint_config(EndpointConfigName="c1", Tags=TAGS[1:], ProductionVariants=[{
        "VariantName": "AllTraffic", "ModelName": "m1", "InstanceType": "ml.m5.large"}])["EndpointConfigArn"]
    untagged = sm.create_model(ModelName="m2", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "image"})["ModelArn"]

    assert tags_of(sm, job) == TAGS
    assert tags_of(sm, model) == TAGS[:1]
    assert tags_of(sm, config) == TAGS[1:]
    assert sm.list_tags(ResourceArn=untagged)["Tags"] == []
    # the pipeline's own reader (DeployFunction's "Object Created" path goes through it)
    assert core_aws.sagemaker_tags(job) == {"atelier:training-job": JOB, "team": "ml platform"}
    wait_for_job(sm, JOB, "Completed", "Failed")


def test_add_tags_replaces_a_value_and_adds_new_keys_after_the_old(sm: Any) -> None:
    arn = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=TAGS, PrimaryContainer={"Image": "image"})["ModelArn"]

    added = sm.add_tags(ResourceArn=arn, Tags=[{"Key": "team", "Value": "research"}, {"Key": "stage", "Value": ""}])

    assert added["Tags"] == [{"Key": "team", "Value": "research"}, {"Key": "stage", "Value": ""}]
    assert tags_of(sm, arn) == [TAGS[0], {"Key": "team", "Value": "research"}, {"Key": "stage", "Value": ""}]


def test_delete_tags_removes_the_keys_and_ignores_keys_the_resource_lacks(sm: Any) -> None:
    arn = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=TAGS, PrimaryContainer={"Image": "image"})["ModelArn"]

    sm.delete_tags(ResourceArn=arn, TagKeys=["team", "never-there"])

    assert tags_of(sm, arn) == TAGS[:1]


def test_list_tags_returns_all_fifty_on_one_page_and_refuses_a_bad_token(sm: Any) -> None:
    fifty = [{"Key": f"k{i:02}", "Value": str(i)} for i in range(50)]
    arn = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=fifty, PrimaryContainer={"Image": "image"})["ModelArn"]

    first = sm.list_tags(ResourceArn=arn, MaxResults=50)

    assert first["Tags"] == fifty and "NextToken" not in first
    assert error_of(lambda: sm.list_tags(ResourceArn=arn, NextToken="not-a-token")) == (
        "ValidationException", "Invalid pagination token")


def test_a_resource_holds_at_most_fifty_tags_and_no_aws_keys(sm: Any) -> None:
    fifty = [{"Key": f"k{i:02}", "Value": str(i)} for i in range(50)]
    arn = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=fifty, PrimaryContainer={"Image": "image"})["ModelArn"]

    code, message = error_of(lambda: sm.add_tags(ResourceArn=arn, Tags=[{"Key": "one-more", "Value": "x"}]))
    assert (code, "at most 50" in message) == ("ValidationException", True)
    assert error_of(lambda: sm.add_tags(ResourceArn=arn, Tags=[{"Key": "aws:owner", "Value": "x"}]))[0] == \
        "ValidationException"
    assert error_of(lambda: sm.add_tags(ResourceArn=arn, Tags=[{"Key": "k00", "Value": "semi;colon"}]))[0] == \
        "ValidationException"
    # a refused request changed nothing, and replacing a value of a full resource is fine
    sm.add_tags(ResourceArn=arn, Tags=[{"Key": "k00", "Value": "zero"}])
    assert tags_of(sm, arn) == [{"Key": "k00", "Value": "zero"}, *fifty[1:]]


def test_a_create_with_bad_tags_is_refused_and_makes_nothing(sm: Any) -> None:
    assert error_of(lambda: sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "i"},
                                            Tags=[{"Key": "aws:x", "Value": "y"}]))[0] == "ValidationException"
    assert error_of(lambda: sm.describe_model(ModelName="m1"))[0] == "ValidationException"


def test_tags_of_an_unknown_or_deleted_resource_are_a_validation_exception(sm: Any) -> None:
    arn = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, Tags=TAGS, PrimaryContainer={"Image": "image"})["ModelArn"]
    sm.delete_model(ModelName="m1")
    unknown = "arn:aws:sagemaker:us-east-1:123456789012:model/never-made"

    for resource in (arn, unknown):
        assert error_of(lambda: sm.list_tags(ResourceArn=resource)) == (
            "ValidationException", f"Could not find resource {resource}.")
        assert error_of(lambda: sm.add_tags(ResourceArn=resource, Tags=TAGS))[0] == "ValidationException"
        assert error_of(lambda: sm.delete_tags(ResourceArn=resource, TagKeys=["team"]))[0] == "ValidationException"
    assert error_of(lambda: sm.list_tags(ResourceArn="arn:aws:s3:::a-bucket"))[0] == "ValidationException"
    # a model made again under the name starts with its own tags, not the deleted one's
    again = sm.create_model(ModelName="m1", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "image"})["ModelArn"]
    assert again == arn and tags_of(sm, again) == []


def test_a_job_event_carries_the_tags_as_they_are_then(sm: Any, s3: Any, job_events: Any) -> None:
    put_shards(s3, "shards/a.tar")
    arn = sm.create_training_job(**training_request(JOB, Tags=TAGS, HyperParameters={"steps": "2", "sleep": "2"}))[
        "TrainingJobArn"]
    job_events(JOB, "InProgress")  # the first event has left; the container lingers 2 s
    sm.add_tags(ResourceArn=arn, Tags=[{"Key": "late", "Value": "yes"}])

    events = job_events(JOB, "Completed")

    assert events[0]["detail"]["Tags"] == {"atelier:training-job": JOB, "team": "ml platform"}
    assert events[-1]["detail"]["Tags"] == {"atelier:training-job": JOB, "team": "ml platform", "late": "yes"}


def test_list_models_sorts_filters_and_pages(sm: Any) -> None:
    for name in ("model-b", "model-a", "other-c"):
        sm.create_model(ModelName=name, ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "image"})

    newest_first = sm.list_models()["Models"]
    by_name = [m["ModelName"] for page in sm.get_paginator("list_models").paginate(
        SortBy="Name", SortOrder="Ascending", NameContains="model", PaginationConfig={"PageSize": 1}) for m in page["Models"]]

    assert [m["ModelName"] for m in newest_first] == ["other-c", "model-a", "model-b"]
    assert newest_first[0]["ModelArn"] == "arn:aws:sagemaker:us-east-1:123456789012:model/other-c"
    assert by_name == ["model-a", "model-b"]
    assert sm.list_models(CreationTimeBefore=newest_first[-1]["CreationTime"])["Models"] == []
