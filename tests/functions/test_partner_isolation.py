"""Partner upload roles on the local stack's moto with IAM enforced: each partner reaches its own
prefix of the uploads bucket, and nothing else.

The roles are made by the code `atelier partner add --principal` runs (atelier.partners.update_role),
the resources by the local stack's provisioner from template.yaml, and every request goes through
`atelier.local.moto_server` after `atelier.local.enforcement` switched enforcement on: moto checks
the signature and the caller's policies, the `s3:prefix` of listings included
(atelier/local/iam_rules.py). Nothing here renders a policy for moto: what is tested is what a
partner's session is allowed. tests/e2e/test_partner_access.py does the same through the CLI.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from atelier import client, partners
from atelier.local import enforcement
from atelier.local.provision import Provisioner
from atelier.local.template import expand
from core.partners.partner_access import PartnerProfile
from tests.support import ACCOUNT, IMAGES, REGION, REPO, STACK, denied

PARTNERS = ("partner-a", "partner-b", "partner-c")


@dataclass
class Enforced:
    url: str
    admin: dict[str, str]  # the administrator's keys, as environment variables
    outputs: dict[str, str]
    keys: dict[str, tuple[str, str]]  # partner -> its own user's access key
    profiles: dict[str, PartnerProfile]

    def client(self, service: str, keys: tuple[str, str] | None = None) -> Any:
        key, secret = keys or (self.admin["AWS_ACCESS_KEY_ID"], self.admin["AWS_SECRET_ACCESS_KEY"])
        return boto3.client(service, endpoint_url=self.url, region_name=REGION, aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def session(self, partner: str, as_partner: str | None = None) -> boto3.Session:
        """`partner`'s role, assumed with the credentials of `as_partner`'s user (default: its own)."""
        key, secret = self.keys[as_partner or partner]
        base = boto3.Session(aws_access_key_id=key, aws_secret_access_key=secret, region_name=REGION)
        return partners.partner_session(self.profiles[partner], base)

    def s3(self, partner: str) -> Any:
        return self.session(partner).client("s3", endpoint_url=self.url)

    @property
    def uploads(self) -> str:
        return self.outputs["UploadsBucketName"]


def user_arn(partner: str) -> str:
    return f"arn:aws:iam::{ACCOUNT}:user/{partner}-uploader"


@pytest.fixture(scope="module")
def enforced() -> Iterator[Enforced]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "atelier.local.moto_server", "127.0.0.1", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine takes a while to import moto
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto at {url} did not answer within 120 s") from None
                time.sleep(0.2)
        admin = enforcement.enforce(url, REGION)
        with pytest.MonkeyPatch.context() as patch:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
                patch.delenv(name, raising=False)
            for name, value in {"AWS_ENDPOINT_URL": url, "AWS_DEFAULT_REGION": REGION, **admin}.items():
                patch.setenv(name, value)
            from core import aws
            aws.reset_clients()
            boto3.DEFAULT_SESSION = None  # one made by an earlier test holds its keys, not the administrator's
            expanded = expand(REPO / "template.yaml", IMAGES, STACK, REGION, ACCOUNT)
            outputs = Provisioner(expanded, STACK, REGION, ACCOUNT, boto3.session.Session().client).provision().outputs
            state = Enforced(url, admin, outputs, {}, {})
            iam = state.client("iam")
            for partner in PARTNERS:
                # GIVEN each partner's own user (on AWS: its identity in its own account), and its role
                name = user_arn(partner).rsplit("/", 1)[1]
                iam.create_user(UserName=name)
                key = iam.create_access_key(UserName=name)["AccessKey"]
                state.keys[partner] = (key["AccessKeyId"], key["SecretAccessKey"])
                role = partners.update_role(STACK, outputs, partner, [user_arn(partner)])
                client.add_partner(outputs, partner, ["CC-BY-4.0"], [], "", principals=[user_arn(partner)])
                # the partner's account lets its user assume that role, and nothing else
                iam.put_user_policy(UserName=name, PolicyName="assume-atelier", PolicyDocument=json.dumps({
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": role}]}))
                state.profiles[partner] = PartnerProfile(partner=partner, bucket=outputs["UploadsBucketName"],
                                                         prefix=f"{partner}/", region=REGION, role_arn=role,
                                                         endpoint_url=url)
            aws.reset_clients()
            boto3.DEFAULT_SESSION = None
        state.s3("partner-b").put_object(Bucket=state.uploads, Key="partner-b/theirs.png", Body=b"b's")
        yield state
    finally:
        server.terminate()
        server.wait(10)
        boto3.DEFAULT_SESSION = None  # the next test's clients read its own environment


def test_a_partner_puts_gets_lists_and_deletes_under_its_own_prefix(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads

    s3.put_object(Bucket=bucket, Key="partner-a/cats/mine.png", Body=b"a's")
    assert s3.get_object(Bucket=bucket, Key="partner-a/cats/mine.png")["Body"].read() == b"a's"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="partner-a/")
    assert [o["Key"] for o in listed["Contents"]] == ["partner-a/cats/mine.png"]
    assert s3.list_objects_v2(Bucket=bucket, Prefix="partner-a/cats/")["KeyCount"] == 1
    upload = s3.create_multipart_upload(Bucket=bucket, Key="partner-a/big.png")["UploadId"]
    assert s3.list_parts(Bucket=bucket, Key="partner-a/big.png", UploadId=upload).get("Parts", []) == []
    s3.abort_multipart_upload(Bucket=bucket, Key="partner-a/big.png", UploadId=upload)
    s3.delete_object(Bucket=bucket, Key="partner-a/cats/mine.png")
    assert s3.list_objects_v2(Bucket=bucket, Prefix="partner-a/")["KeyCount"] == 0


def test_a_partner_can_neither_write_read_list_nor_delete_under_another_s_prefix(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads

    assert denied(s3.put_object, Bucket=bucket, Key="partner-b/forged.png", Body=b"a's")
    assert denied(s3.create_multipart_upload, Bucket=bucket, Key="partner-b/forged.png")
    assert denied(s3.get_object, Bucket=bucket, Key="partner-b/theirs.png")
    with pytest.raises(ClientError) as head:
        s3.head_object(Bucket=bucket, Key="partner-b/theirs.png")
    assert head.value.response["Error"]["Code"] == "403"  # a HEAD answer has no body to name the error
    assert denied(s3.list_objects_v2, Bucket=bucket, Prefix="partner-b/")
    assert denied(s3.list_objects, Bucket=bucket, Prefix="partner-b/")
    assert denied(s3.list_objects_v2, Bucket=bucket)  # the whole bucket: every partner's keys
    assert denied(s3.list_objects_v2, Bucket=bucket, Prefix="partner-a")  # no slash: partner-ab/ too
    assert denied(s3.delete_object, Bucket=bucket, Key="partner-b/theirs.png")
    bulk = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "partner-b/theirs.png"}]})
    assert [(e["Key"], e["Code"]) for e in bulk["Errors"]] == [("partner-b/theirs.png", "AccessDenied")]
    # THEN B's object is as B left it
    theirs = enforced.client("s3").get_object(Bucket=bucket, Key="partner-b/theirs.png")
    assert theirs["Body"].read() == b"b's"


def test_a_partner_copies_and_part_copies_within_its_own_prefix(enforced: Enforced) -> None:
    # AWS authorises a copy as s3:GetObject on the source and s3:PutObject on the destination: both A's
    s3, bucket = enforced.s3("partner-a"), enforced.uploads
    s3.put_object(Bucket=bucket, Key="partner-a/original.png", Body=b"a's" * 2048)

    s3.copy_object(Bucket=bucket, Key="partner-a/copy.png", CopySource={"Bucket": bucket, "Key": "partner-a/original.png"})
    upload = s3.create_multipart_upload(Bucket=bucket, Key="partner-a/parts.png")["UploadId"]
    part = s3.upload_part_copy(Bucket=bucket, Key="partner-a/parts.png", UploadId=upload, PartNumber=1,
                               CopySource={"Bucket": bucket, "Key": "partner-a/original.png"})
    s3.complete_multipart_upload(Bucket=bucket, Key="partner-a/parts.png", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": part["CopyPartResult"]["ETag"]}]})

    for key in ("partner-a/copy.png", "partner-a/parts.png"):
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b"a's" * 2048
        s3.delete_object(Bucket=bucket, Key=key)
    s3.delete_object(Bucket=bucket, Key="partner-a/original.png")


def sources(enforced: Enforced) -> list[dict[str, str]]:
    """Objects partner A may not read: B's upload (its current and its named version), a shard, a model."""
    admin, bucket = enforced.client("s3"), enforced.uploads
    version = admin.head_object(Bucket=bucket, Key="partner-b/theirs.png")["VersionId"]
    found = [{"Bucket": bucket, "Key": "partner-b/theirs.png"},
             {"Bucket": bucket, "Key": "partner-b/theirs.png", "VersionId": version}]
    for name, key in (("DataBucketName", "shards/shard-1.tar"), ("ModelsBucketName", "training/j/output/model.tar.gz")):
        admin.put_object(Bucket=enforced.outputs[name], Key=key, Body=b"not the partner's")
        found.append({"Bucket": enforced.outputs[name], "Key": key})
    return found


def test_a_partner_cannot_copy_what_it_may_not_read_into_its_own_prefix(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads

    for source in sources(enforced):
        assert denied(s3.copy_object, Bucket=bucket, Key="partner-a/stolen.png", CopySource=source), source
        assert denied(s3.copy_object, Bucket=bucket, Key="partner-a/stolen.png", CopySource=source,
                      MetadataDirective="REPLACE", Metadata={"x": "y"}), source

    assert enforced.client("s3").list_objects_v2(Bucket=bucket, Prefix="partner-a/stolen")["KeyCount"] == 0


def test_a_partner_cannot_part_copy_what_it_may_not_read_into_an_upload_of_its_own(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads
    upload = s3.create_multipart_upload(Bucket=bucket, Key="partner-a/stolen.png")["UploadId"]

    for source in sources(enforced):
        assert denied(s3.upload_part_copy, Bucket=bucket, Key="partner-a/stolen.png", UploadId=upload, PartNumber=1,
                      CopySource=source), source
        assert denied(s3.upload_part_copy, Bucket=bucket, Key="partner-a/stolen.png", UploadId=upload, PartNumber=1,
                      CopySource=source, CopySourceRange="bytes=0-1"), source

    assert s3.list_parts(Bucket=bucket, Key="partner-a/stolen.png", UploadId=upload).get("Parts", []) == []
    s3.abort_multipart_upload(Bucket=bucket, Key="partner-a/stolen.png", UploadId=upload)


def test_a_partner_cannot_copy_even_its_own_object_s_earlier_version(enforced: Enforced) -> None:
    # a named version is read with s3:GetObjectVersion, which a partner role is not given
    s3, bucket = enforced.s3("partner-a"), enforced.uploads
    version = s3.put_object(Bucket=bucket, Key="partner-a/versioned.png", Body=b"first")["VersionId"]
    source = {"Bucket": bucket, "Key": "partner-a/versioned.png", "VersionId": version}

    assert denied(s3.copy_object, Bucket=bucket, Key="partner-a/again.png", CopySource=source)
    assert denied(s3.get_object, Bucket=bucket, Key="partner-a/versioned.png", VersionId=version)
    s3.delete_object(Bucket=bucket, Key="partner-a/versioned.png")


def test_a_partner_cannot_select_from_nor_restore_another_s_object(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads

    assert denied(s3.select_object_content, Bucket=bucket, Key="partner-b/theirs.png", ExpressionType="SQL",
                  Expression="SELECT * FROM S3Object", InputSerialization={"CSV": {}}, OutputSerialization={"CSV": {}})
    assert denied(s3.restore_object, Bucket=bucket, Key="partner-b/theirs.png", RestoreRequest={"Days": 1})


def test_a_partner_writes_no_key_outside_a_folder_of_its_own(enforced: Enforced) -> None:
    s3, bucket = enforced.s3("partner-a"), enforced.uploads

    assert denied(s3.put_object, Bucket=bucket, Key="partner-a.png", Body=b"a's")
    assert denied(s3.put_object, Bucket=bucket, Key="partner-ab/x.png", Body=b"a's")
    assert denied(s3.put_object, Bucket=bucket, Key="x.png", Body=b"a's")


def test_a_partner_reaches_no_other_bucket_nor_the_pipeline(enforced: Enforced) -> None:
    session = enforced.session("partner-a")
    s3 = session.client("s3", endpoint_url=enforced.url)
    for bucket in (enforced.outputs["DataBucketName"], enforced.outputs["ModelsBucketName"]):
        assert denied(s3.put_object, Bucket=bucket, Key="partner-a/x.png", Body=b"a's")
        assert denied(s3.list_objects_v2, Bucket=bucket, Prefix="partner-a/")
    table = session.client("dynamodb", endpoint_url=enforced.url)
    with pytest.raises(ClientError, match="AccessDenied"):
        table.get_item(TableName=enforced.outputs["PipelineTableName"], Key={"pk": {"S": "PARTNER#partner-a"}})
    with pytest.raises(ClientError, match="AccessDenied"):
        session.client("sqs", endpoint_url=enforced.url).send_message(
            QueueUrl=enforced.outputs["UploadsQueueUrl"], MessageBody="{}")


def test_only_the_principal_a_role_names_can_assume_it(enforced: Enforced) -> None:
    # B's user may assume roles in its own account's eyes, but A's role does not trust it
    iam = enforced.client("iam")
    iam.put_user_policy(UserName="partner-b-uploader", PolicyName="assume-any", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}]}))
    try:
        with pytest.raises(ClientError, match="AccessDenied"):
            enforced.session("partner-a", as_partner="partner-b")
    finally:
        iam.delete_user_policy(UserName="partner-b-uploader", PolicyName="assume-any")


def test_registering_a_partner_again_without_principals_removes_its_role(enforced: Enforced) -> None:
    enforced.s3("partner-c")  # assumable before
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"AWS_ENDPOINT_URL": enforced.url, **enforced.admin}.items():
            patch.setenv(name, value)
        from core import aws
        aws.reset_clients()
        assert partners.update_role(STACK, enforced.outputs, "partner-c", []) is None
        aws.reset_clients()
    with pytest.raises(ClientError) as refused:
        enforced.session("partner-c")
    assert refused.value.response["Error"]["Code"] in {"AccessDenied", "NoSuchEntity"}


def test_moto_substitutes_no_policy_variable(enforced: Enforced) -> None:
    # Why every partner has a role naming its prefix: a policy with ${aws:username} (or
    # ${aws:PrincipalTag/partner}) would grant nothing locally. If this fails, moto learnt to
    # substitute them: the local stack could then test a shared, tag-based role.
    iam = enforced.client("iam")
    iam.create_user(UserName="variable")
    iam.put_user_policy(UserName="variable", PolicyName="own-folder", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:PutObject",
                                                "Resource": f"arn:aws:s3:::{enforced.uploads}/${{aws:username}}/*"}]}))
    key = iam.create_access_key(UserName="variable")["AccessKey"]
    s3 = enforced.client("s3", (key["AccessKeyId"], key["SecretAccessKey"]))

    assert denied(s3.put_object, Bucket=enforced.uploads, Key="variable/x.png", Body=b"v")
