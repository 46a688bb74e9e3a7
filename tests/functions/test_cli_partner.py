"""`atelier partner add --principal` and `atelier partner export` against moto with the template's
resources (no IAM enforced: what the role allows is tests/functions/test_partner_isolation.py's),
and what `atelier upload` refuses before it sends anything."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from atelier import cli
from atelier.local.provision import Provisioned
from contracts.pipeline_table import partner_pk
from core import aws
from core.partners.licensing import get_partner
from core.partners.partner_access import ROLE_POLICY_NAME, read_profile, role_policy
from tests.functions.test_audit import register_outputs

UPLOADER = "arn:aws:iam::111122223333:role/acme-uploads"
ROLE = "arn:aws:iam::123456789012:role/atelier/partners/atelier-partner-acme"


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    register_outputs(module_stack)  # the CLI finds the buckets and the table in the stack's outputs
    return module_stack


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


def test_a_partner_given_a_principal_gets_a_role_bounded_by_the_template_s_boundary(
        stack: Provisioned, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "acme", "--license", "CC-BY-4.0", "--principal", UPLOADER]) == 0

    assert f"upload role {ROLE}, assumable by {UPLOADER}" in capsys.readouterr().out
    iam = boto3.client("iam")
    role = iam.get_role(RoleName="atelier-partner-acme")["Role"]
    assert role["PermissionsBoundary"]["PermissionsBoundaryArn"] == stack.outputs["PartnerBoundaryArn"]
    assert role["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"AWS": [UPLOADER]}
    policy = iam.get_role_policy(RoleName="atelier-partner-acme", PolicyName=ROLE_POLICY_NAME)["PolicyDocument"]
    assert policy == role_policy("aws", stack.outputs["UploadsBucketName"], "acme")
    assert get_partner(stack.outputs["PipelineTableName"], "acme").principals == (UPLOADER,)


def test_the_export_is_a_profile_for_aws_with_the_bucket_prefix_region_and_role(
        stack: Provisioned, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "acme", "--license", "CC-BY-4.0", "--principal", UPLOADER]) == 0
    capsys.readouterr()

    assert cli.main(["partner", "export", "acme"]) == 0

    profile = read_profile(capsys.readouterr().out)
    assert (profile.partner, profile.bucket, profile.prefix, profile.region, profile.role_arn, profile.endpoint_url) == (
        "acme", stack.outputs["UploadsBucketName"], "acme/", "us-east-1", ROLE, "")


def test_registering_again_without_a_principal_removes_the_role_and_the_export(
        stack: Provisioned, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "gone", "--license", "CC-BY-4.0", "--principal", UPLOADER]) == 0
    assert cli.main(["partner", "add", "gone", "--license", "CC-BY-4.0"]) == 0
    capsys.readouterr()

    with pytest.raises(boto3.client("iam").exceptions.NoSuchEntityException):
        boto3.client("iam").get_role(RoleName="atelier-partner-gone")
    assert cli.main(["partner", "export", "gone"]) == 2
    assert "partner 'gone' has no upload role: give it one with `atelier partner add gone" in one_error(capsys)


def test_a_partner_without_principals_is_stored_as_before_them(stack: Provisioned) -> None:
    # functions deployed before the field still read the entry (Frozen models forbid unknown fields)
    assert cli.main(["partner", "add", "plain", "--license", "CC-BY-4.0"]) == 0
    record = json.loads(aws.get_item(stack.outputs["PipelineTableName"], partner_pk("plain"))["record"])
    assert "principals" not in record


def test_a_principal_that_is_not_a_role_or_user_arn_is_refused_before_anything_is_written(
        stack: Provisioned, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["partner", "add", "wide", "--license", "CC-BY-4.0", "--principal", "111122223333"]) == 2

    assert one_error(capsys).startswith("error: --principal '111122223333' must be an IAM role or user ARN")
    assert get_partner(stack.outputs["PipelineTableName"], "wide") is None


def test_an_upload_needs_a_partner_or_a_profile_that_is_one(stack: Provisioned, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.png").write_bytes(b"png")
    assert cli.main(["-q", "upload", str(tmp_path / "a.png")]) == 2
    assert "name the partner (--partner ID), or upload with its profile (--profile partner.toml)" in one_error(capsys)

    (tmp_path / "partner.toml").write_text('partner = "acme"\n')
    assert cli.main(["-q", "upload", str(tmp_path / "a.png"), "--profile", str(tmp_path / "partner.toml")]) == 2
    assert "partner.toml is not a partner profile (bucket: Field required)" in one_error(capsys)
