"""core.partners.partner_access: a partner role's name, policies and profile, and how template.yaml bounds them
(what a session may do is tested with IAM enforced: tests/functions/test_partner_isolation.py)."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import pytest

from core.partners.partner_access import (
    ROLE_PATH,
    AccessError,
    PartnerProfile,
    check_principals,
    prefix_of,
    read_profile,
    render_profile,
    role_name,
    role_policy,
    trust_policy,
)
from tests.unit.template_helpers import expand_with, resolve

BUCKET = "atelier-uploads-123456789012-us-east-1"
KEY = "arn:aws:kms:us-east-1:123456789012:key/storage"
USER = "arn:aws:iam::111122223333:user/acme-uploads"
ROLE = "arn:aws:iam::123456789012:role/atelier/partners/atelier-partner-acme"


def profile(**changes: Any) -> PartnerProfile:
    return PartnerProfile(**{"partner": "acme", "bucket": BUCKET, "prefix": "acme/", "region": "us-east-1",
                             "role_arn": ROLE, **changes})


# --- the role -------------------------------------------------------------------------------------

def test_the_role_allows_objects_under_the_partner_s_folder_and_a_listing_of_that_folder_alone() -> None:
    assert role_policy("aws", BUCKET, "acme") == {"Version": "2012-10-17", "Statement": [
        {"Sid": "OwnPrefixObjects", "Effect": "Allow",
         "Action": ["s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts"],
         "Resource": f"arn:aws:s3:::{BUCKET}/acme/*"},
        {"Sid": "OwnPrefixListing", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{BUCKET}",
         "Condition": {"StringLike": {"s3:prefix": ["acme/*"]}}}]}


def test_the_role_may_use_the_storage_key_only_when_there_is_one() -> None:
    # S3: a PUT to an SSE-KMS bucket needs kms:GenerateDataKey; a multipart upload kms:Decrypt too
    # (S3 User Guide, "Protecting data with server-side encryption using AWS KMS keys").
    keyed = role_policy("aws", BUCKET, "acme", KEY)["Statement"]
    assert [s for s in keyed if s["Sid"] == "StorageKey"] == [
        {"Sid": "StorageKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"], "Resource": KEY}]
    assert all("kms" not in json.dumps(s) for s in role_policy("aws", BUCKET, "acme")["Statement"])


def test_no_partner_policy_uses_a_policy_variable() -> None:
    # moto substitutes none: a variable would make the local stack test nothing (or grant nothing)
    assert "${" not in json.dumps(role_policy("aws", BUCKET, "acme", KEY))
    assert "${" not in json.dumps(trust_policy((USER,)))


def test_only_the_named_principals_may_assume_the_role() -> None:
    assert trust_policy((USER, USER)) == {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": [USER]}, "Action": "sts:AssumeRole"}]}


@pytest.mark.parametrize("principal", ["111122223333", "arn:aws:iam::111122223333:root", "*",
                                       "arn:aws:sts::111122223333:assumed-role/x/y", "arn:aws:iam::1111:user/x"])
def test_a_principal_is_an_iam_role_or_user_arn_never_an_account_or_anyone(principal: str) -> None:
    with pytest.raises(AccessError, match="must be an IAM role or user ARN"):
        check_principals([principal])


def test_a_role_is_named_for_its_stack_and_partner_within_iam_s_64_characters() -> None:
    assert role_name("atelier", "acme") == "atelier-partner-acme"
    long = role_name("atelier", "a" * 64)
    assert len(long) == 64 and long.startswith("atelier-partner-aaaa") and long != role_name("atelier", "a" * 63 + "b")
    with pytest.raises(AccessError, match="too long"):
        role_name("s" * 46, "acme")
    with pytest.raises(AccessError, match="lower-case"):
        role_name("atelier", "Acme")


def test_a_prefix_is_a_folder() -> None:
    assert prefix_of("acme") == "acme/"


# --- the template bounds every partner role --------------------------------------------------------

def statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    found = document["Statement"]
    return found if isinstance(found, list) else [found]


def listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize("key", ["", KEY])
def test_the_boundary_allows_every_action_a_partner_role_is_given(key: str) -> None:
    # A boundary caps what a role's own policy allows (IAM User Guide, "Permissions boundaries"):
    # whatever the role allows must be inside it, on AWS. (moto does not evaluate boundaries.)
    resources = resolve(expand_with({"StorageKmsKeyArn": key} if key else {}))
    boundary = resources["PartnerBoundary"]["Properties"]["PolicyDocument"]
    allowed = {(action, resource) for s in statements(boundary) if s["Effect"] == "Allow"
               for action in listed(s["Action"]) for resource in listed(s["Resource"])}
    bucket_arn = "UploadsBucket.Arn"  # what GetAtt resolves to in these tests
    for statement in role_policy("aws", "BUCKET", "acme", key)["Statement"]:
        for action in listed(statement["Action"]):
            resource = statement["Resource"].replace("arn:aws:s3:::BUCKET", bucket_arn)
            assert any(action == a and fnmatch.fnmatchcase(resource, r) for a, r in allowed), (action, resource)


def test_operators_may_make_partner_roles_only_of_this_stack_on_the_path_and_with_the_boundary() -> None:
    admin = statements(resolve(expand_with({}))["PartnerAdminPolicy"]["Properties"]["PolicyDocument"])
    resources = {r for s in admin for r in listed(s["Resource"])}
    role_arn = "arn:aws:iam::123456789012:role" + ROLE_PATH + "{}"

    assert resources == {role_arn.format("atelier-partner-*")}
    [pattern] = resources
    assert fnmatch.fnmatchcase(role_arn.format(role_name("atelier", "acme")), pattern)
    assert fnmatch.fnmatchcase(role_arn.format(role_name("atelier", "a" * 64)), pattern)
    assert not fnmatch.fnmatchcase(role_arn.format(role_name("atelier-dev", "acme")), pattern)
    granting = [s for s in admin if "iam:CreateRole" in listed(s["Action"])]
    assert [s["Condition"] for s in granting] == [{"StringEquals": {"iam:PermissionsBoundary": "PartnerBoundary"}}]
    assert {"iam:PutRolePolicy", "iam:PutRolePermissionsBoundary", "iam:DeleteRolePolicy"} <= set(granting[0]["Action"])


# --- the profile --------------------------------------------------------------------------------

def test_a_profile_reads_back_as_it_was_rendered_and_names_who_may_use_it() -> None:
    local = profile(endpoint_url="http://127.0.0.1:5100")
    text = render_profile(local, (USER,))

    assert read_profile(text) == local
    assert f"#   {USER}" in text and "atelier upload --profile partner.toml PATH" in text
    assert read_profile(render_profile(profile(), (USER,))).endpoint_url == ""


@pytest.mark.parametrize(("text", "why"), [
    ('partner = "acme"', "bucket: Field required"),
    ('partner = "acme"\nbucket = "b-1"\nprefix = "other/"\nregion = "r"\nrole_arn = "' + ROLE + '"', "prefix must be 'acme/'"),
    ('partner = "acme"\nbucket = "b-1"\nprefix = "acme/"\nregion = "r"\nrole_arn = "arn:aws:iam::1:user/x"', "role_arn"),
    ('partner = "acme"\nbucket = "b-1"\nprefix = "acme/"\nregion = "r"\nrole_arn = "' + ROLE + '"\nsecret = "x"',
     "secret: Extra inputs are not permitted"),
    ("partner = ", "not TOML"),
])
def test_a_profile_that_is_not_one_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(AccessError, match=why):
        read_profile(text)
