"""PartnerUploadRole under moto with IAM enforced: a partner writes under its own prefix, nothing else.

moto checks IAM policies only when INITIAL_NO_AUTH_ACTION_COUNT is set before it starts, so this
runs a moto server of its own. moto does not substitute policy variables: the test renders the
role's policy for one session as IAM does (`${aws:PrincipalTag/partner}` -> the session's tag).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from atelier.local.template import Resolver, expand
from tests.support import ACCOUNT, IMAGES, REGION, REPO, STACK

NAMES = {"UploadsBucket": "atelier-uploads", "DataBucket": "atelier-data", "ModelsBucket": "atelier-models"}
TAG_VARIABLE = "${aws:PrincipalTag/partner}"


def role(overrides: dict[str, str]) -> dict[str, Any]:
    """PartnerUploadRole's properties from template.yaml, bucket names as above."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_DEFAULT_REGION", REGION)
        expanded = expand(REPO / "template.yaml", {**IMAGES, **overrides}, STACK, REGION, ACCOUNT)
    resolver = Resolver(expanded.parameters, expanded.conditions, ref=lambda name: NAMES.get(name, name),
                        get_att=lambda name, attribute: f"arn:aws:s3:::{NAMES[name]}",
                        list_parameters=expanded.list_parameters)
    return resolver.resolve(expanded.resources["PartnerUploadRole"]["Properties"])


@pytest.fixture
def moto_with_iam() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The first 3 requests (the admin user, its policy, its key) are not checked; all later ones are.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def session(url: str, key: dict[str, str] | None = None) -> Any:
    credentials = (key["AccessKeyId"], key["SecretAccessKey"]) if key else ("testing", "testing")
    return lambda service: boto3.client(service, endpoint_url=url, region_name=REGION,
                                        aws_access_key_id=credentials[0], aws_secret_access_key=credentials[1])


def user_with(client: Any, name: str, policy: dict[str, Any]) -> dict[str, str]:
    iam = client("iam")
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
    return iam.create_access_key(UserName=name)["AccessKey"]


def allowed(call: Any, **kwargs: Any) -> bool:
    try:
        call(**kwargs)
        return True
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "AccessDenied", exc
        return False


def test_a_partner_writes_only_under_its_own_prefix(moto_with_iam: str) -> None:
    # GIVEN an admin, the three buckets, and partner A's session policy as IAM evaluates it
    admin = session(moto_with_iam, user_with(session(moto_with_iam), "admin", {
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    for bucket in NAMES.values():
        admin("s3").create_bucket(Bucket=bucket)
    admin("s3").put_object(Bucket=NAMES["UploadsBucket"], Key="partner-b/theirs.jpg", Body=b"b")
    [policy] = role({"PartnerIds": "partner-a,partner-b"})["Policies"]
    rendered = json.loads(json.dumps(policy["PolicyDocument"]).replace(TAG_VARIABLE, "partner-a"))
    s3 = session(moto_with_iam, user_with(admin, "partner-a-session", rendered))("s3")
    uploads, data, models = NAMES["UploadsBucket"], NAMES["DataBucket"], NAMES["ModelsBucket"]
    time.sleep(0.5)  # moto's IAM is eventually consistent, as IAM is
    # THEN
    assert allowed(s3.put_object, Bucket=uploads, Key="partner-a/mine.jpg", Body=b"a")
    assert not allowed(s3.put_object, Bucket=uploads, Key="partner-b/forged.jpg", Body=b"a")
    assert not allowed(s3.put_object, Bucket=uploads, Key="partner-a.jpg", Body=b"a")  # the prefix is a folder
    assert not allowed(s3.get_object, Bucket=uploads, Key="partner-b/theirs.jpg")
    assert not allowed(s3.get_object, Bucket=uploads, Key="partner-a/mine.jpg")  # write-only, even its own
    assert not allowed(s3.list_objects_v2, Bucket=uploads)
    for bucket in (data, models):
        assert not allowed(s3.put_object, Bucket=bucket, Key="partner-a/x.jpg", Body=b"a")
        assert not allowed(s3.list_objects_v2, Bucket=bucket)


def test_only_listed_partners_can_start_a_session() -> None:
    trust = role({"PartnerIds": "partner-a,partner-b"})["AssumeRolePolicyDocument"]["Statement"]
    assert [s["Condition"] for s in trust] == [{
        "StringEquals": {"aws:RequestTag/partner": ["partner-a", "partner-b"]},
        "ForAllValues:StringEquals": {"aws:TagKeys": ["partner"]}}]
    assert [s["Action"] for s in trust] == [["sts:AssumeRole", "sts:TagSession"]]
