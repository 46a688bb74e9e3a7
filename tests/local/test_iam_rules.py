"""atelier/local/iam_rules.py: the `s3:prefix` of a listing decided as IAM decides it, where moto counts
every condition as met, and a copy authorised on its source as well as its destination (the rules on a
whole moto server: tests/functions/test_partner_isolation.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from moto.iam.access_control import IAMPolicy, PermissionResult

from atelier.local.iam_rules import allowed, copy_allowed, copy_source_read, iam_action, request_context
from core.partners.partner_access import role_policy

BUCKET = "arn:aws:s3:::uploads"


def policy(*statements: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"Version": "2012-10-17", "Statement": list(statements)}]


def listing(condition: dict[str, Any], effect: str = "Allow") -> dict[str, Any]:
    return {"Effect": effect, "Action": "s3:ListBucket", "Resource": BUCKET, "Condition": condition}


OWN_FOLDER = listing({"StringLike": {"s3:prefix": ["partner-a/*"]}})


def test_moto_alone_counts_an_s3_prefix_condition_as_met() -> None:
    # why the rule exists: with this, moto lets partner A list partner B's folder
    moto = IAMPolicy({"policy_document": json.dumps(policy(OWN_FOLDER)[0])})
    assert moto.is_action_permitted("s3:ListBucket", BUCKET) == PermissionResult.PERMITTED


@pytest.mark.parametrize(("path", "expected"), [
    ("/uploads?list-type=2&prefix=partner-a%2F", True), ("/uploads?prefix=partner-a/cats/", True),
    ("/uploads?list-type=2&prefix=partner-b%2F", False), ("/uploads?list-type=2", False),  # no prefix: the whole bucket
    ("/uploads?list-type=2&prefix=", False), ("/uploads?list-type=2&prefix=partner-a", False),
])
def test_a_listing_is_allowed_only_under_the_prefix_the_condition_names(path: str, expected: bool) -> None:
    assert allowed(policy(OWN_FOLDER), "s3:ListBucket", BUCKET, request_context(path)) is expected


def test_a_negated_operator_or_if_exists_passes_when_the_request_has_no_prefix() -> None:
    assert allowed(policy(listing({"StringNotLike": {"s3:prefix": ["secret/*"]}})), "s3:ListBucket", BUCKET, {})
    assert allowed(policy(listing({"StringLikeIfExists": {"s3:prefix": ["a/*"]}})), "s3:ListBucket", BUCKET, {})
    assert not allowed(policy(listing({"StringNotLike": {"s3:prefix": ["secret/*"]}})), "s3:ListBucket", BUCKET,
                       {"s3:prefix": "secret/x"})


def test_an_explicit_deny_wins_and_nothing_allowed_is_denied() -> None:
    everything = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    deny_b = listing({"StringLike": {"s3:prefix": "partner-b/*"}}, effect="Deny")
    assert not allowed(policy(everything, deny_b), "s3:ListBucket", BUCKET, {"s3:prefix": "partner-b/"})
    assert allowed(policy(everything, deny_b), "s3:ListBucket", BUCKET, {"s3:prefix": "partner-a/"})
    assert not allowed(policy({"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}), "s3:ListBucket", BUCKET, {})
    assert not allowed(policy({**OWN_FOLDER, "Resource": "arn:aws:s3:::other"}), "s3:ListBucket", BUCKET,
                       {"s3:prefix": "partner-a/"})


def test_an_operator_not_modelled_on_s3_prefix_is_refused_and_other_keys_are_as_moto_has_them() -> None:
    assert not allowed(policy(listing({"ForAnyValue:StringLike": {"s3:prefix": "a/*"}})), "s3:ListBucket", BUCKET,
                       {"s3:prefix": "a/"})
    assert allowed(policy(listing({"Bool": {"aws:SecureTransport": "true"}})), "s3:ListBucket", BUCKET, {})


# --- copies: the source read, the destination written --------------------------------------------

PARTNER_A = [role_policy("aws", "uploads", "partner-a")]


@pytest.mark.parametrize(("header", "expected"), [
    ("uploads/partner-b/x.png", ("s3:GetObject", "arn:aws:s3:::uploads/partner-b/x.png")),
    ("/uploads/partner-b/a%20b%2Bc.png", ("s3:GetObject", "arn:aws:s3:::uploads/partner-b/a b+c.png")),
    ("uploads/partner-a/x.png?versionId=3HL4kqtJ", ("s3:GetObjectVersion", "arn:aws:s3:::uploads/partner-a/x.png")),
    ("uploads/partner-a/why%3F.png", ("s3:GetObject", "arn:aws:s3:::uploads/partner-a/why?.png")),
    ("uploads", None), ("uploads/", None), ("", None),
])
def test_a_copy_source_is_read_as_the_object_moto_copies(header: str, expected: tuple[str, str] | None) -> None:
    assert copy_source_read(header, "aws") == expected


@pytest.mark.parametrize(("header", "destination", "expected"), [
    ("uploads/partner-a/x.png", "arn:aws:s3:::uploads/partner-a/y.png", True),
    ("uploads/partner-b/x.png", "arn:aws:s3:::uploads/partner-a/y.png", False),  # B's bytes into A's folder
    ("data/shards/s.tar", "arn:aws:s3:::uploads/partner-a/y.png", False),  # another bucket's
    ("uploads/partner-a/x.png", "arn:aws:s3:::uploads/partner-b/y.png", False),  # A's bytes into B's folder
    ("uploads/partner-a/x.png?versionId=v1", "arn:aws:s3:::uploads/partner-a/y.png", False),  # no GetObjectVersion
    ("uploads", "arn:aws:s3:::uploads/partner-a/y.png", False),  # names no object
])
def test_a_copy_is_allowed_only_when_the_source_may_be_read_and_the_destination_put(
        header: str, destination: str, expected: bool) -> None:
    assert copy_allowed(PARTNER_A, header, destination) is expected


@pytest.mark.parametrize(("action", "path", "expected"), [
    ("s3:ListObjectsV2", "/b?list-type=2&prefix=partner-a%2F", "s3:ListBucket"),  # moto 5.2.6 names the operation
    ("s3:ListBucket", "/b?prefix=partner-a%2F", "s3:ListBucket"),  # earlier versions named the action
    ("s3:HeadObject", "/b/partner-a/x.png", "s3:GetObject"),
    ("s3:UploadPart", "/b/partner-a/x.png?partNumber=1&uploadId=u", "s3:PutObject"),
    ("s3:GetObject", "/b/partner-a/x.png?versionId=v1", "s3:GetObjectVersion"),
    ("s3:DeleteObject", "/b/partner-a/x.png?versionId=v1", "s3:DeleteObjectVersion"),
    ("s3:ListMultipartUploads", "/b?uploads", "s3:ListBucketMultipartUploads"),
    ("s3:DeleteObjects", "/b?delete", "s3:DeleteObjects"),  # no such action: refused, as docs/aws-differences.md says
])
def test_an_s3_operation_is_authorised_as_the_iam_action_aws_names_for_it(action: str, path: str, expected: str) -> None:
    assert iam_action(action, path) == expected
