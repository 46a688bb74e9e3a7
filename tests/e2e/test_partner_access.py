"""Partner profiles on the local stack with IAM enforced (`atelier local up --enforce-iam`), as an
operator and two partners use them: `atelier partner add --principal`, `atelier partner export`,
then `atelier upload --profile` run by each partner with its own credentials and nothing else.

The operator runs as the stack's administrator (`--local`); each partner is an IAM user of its own
(on AWS: an identity in its own account) allowed to assume its upload role and nothing more. Every
request a partner makes is checked by moto against the role's policies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from atelier import partners
from atelier.catalog import encode, picture
from atelier.local.stack import LocalStack, StackOptions
from core.partners.partner_access import PartnerProfile, read_profile
from tests.support import ACCOUNT, REGION, REPO, denied

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=20)]
PARTNERS = ("partner-a", "partner-b")


@dataclass
class Partner:
    name: str
    keys: tuple[str, str]  # its own user's access key: all it holds besides the profile
    profile_path: Path
    profile: PartnerProfile

    def env(self, home: Path) -> dict[str, str]:
        """A shell with the partner's credentials and no other AWS setting (no endpoint, no profile)."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {**clean, "HOME": str(home), "AWS_ACCESS_KEY_ID": self.keys[0], "AWS_SECRET_ACCESS_KEY": self.keys[1],
                "AWS_CONFIG_FILE": str(home / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(home / "none")}

    def session(self) -> boto3.Session:
        """The role's session, assumed with the partner's own key, as `atelier upload --profile` assumes it."""
        base = boto3.Session(aws_access_key_id=self.keys[0], aws_secret_access_key=self.keys[1], region_name=REGION)
        return partners.partner_session(self.profile, base)


@dataclass
class Enforced:
    stack: LocalStack
    state: Path
    partners: dict[str, Partner]

    def admin(self, service: str) -> Any:
        env = self.stack.env
        return boto3.client(service, endpoint_url=env["AWS_ENDPOINT_URL"], region_name=REGION,
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])

    @property
    def uploads(self) -> str:
        return self.stack.outputs["UploadsBucketName"]


def atelier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "atelier.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


@pytest.fixture(scope="module")
def enforced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Enforced]:
    root = tmp_path_factory.mktemp("partner-access")
    state = root / "local"
    with LocalStack(StackOptions(root=REPO, state_dir=state, moto_port=0, sagemaker_port=0, enforce_iam=True)) as stack:
        setup = Enforced(stack, state, {})
        iam = setup.admin("iam")
        for name in PARTNERS:
            # GIVEN the partner's own user, then the operator's registration and export
            user = f"{name}-uploader"
            iam.create_user(UserName=user)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            operator = ("--state-dir", str(state), "--local", "partner")
            added = atelier(*operator, "add", name, "--license", "CC-BY-4.0",
                            "--principal", f"arn:aws:iam::{ACCOUNT}:user/{user}")
            assert added.returncode == 0, added.stderr
            exported = atelier(*operator, "export", name)
            assert exported.returncode == 0, exported.stderr
            path = root / f"{name}.toml"
            path.write_text(exported.stdout)
            profile = read_profile(exported.stdout)
            # the partner's account lets its user assume that role, and nothing else
            iam.put_user_policy(UserName=user, PolicyName="assume-atelier", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": profile.role_arn}]}))
            setup.partners[name] = Partner(name, (key["AccessKeyId"], key["SecretAccessKey"]), path, profile)
        yield setup


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    folder = tmp_path / "catalog"
    (folder / "shapes").mkdir(parents=True)
    (folder / "shapes" / "red.png").write_bytes(encode(picture("circle", "red", "blue"), "png"))
    (folder / "shapes" / "red.json").write_text('{"caption": "a red circle", "license": "CC-BY-4.0"}')
    return folder


def test_the_exported_profile_names_the_bucket_prefix_and_role_and_holds_no_secret(enforced: Enforced) -> None:
    a = enforced.partners["partner-a"]
    text = a.profile_path.read_text()

    assert (a.profile.bucket, a.profile.prefix, a.profile.region) == (enforced.uploads, "partner-a/", REGION)
    assert a.profile.role_arn == f"arn:aws:iam::{ACCOUNT}:role/atelier/partners/atelier-partner-partner-a"
    assert a.profile.endpoint_url == enforced.stack.env["AWS_ENDPOINT_URL"]
    assert enforced.stack.env["AWS_SECRET_ACCESS_KEY"] not in text and a.keys[1] not in text
    assert not {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"} & set(text.split())


def test_a_partner_uploads_with_its_profile_and_its_own_credentials_alone(enforced: Enforced, catalog: Path,
                                                                           tmp_path: Path) -> None:
    a = enforced.partners["partner-a"]

    uploaded = atelier("upload", "--profile", str(a.profile_path), str(catalog), env=a.env(tmp_path))

    assert uploaded.returncode == 0, uploaded.stderr
    assert "2 objects uploaded for partner partner-a" in uploaded.stdout
    listed = enforced.admin("s3").list_objects_v2(Bucket=enforced.uploads, Prefix="partner-a/")
    assert sorted(o["Key"] for o in listed["Contents"]) == ["partner-a/shapes/red.json", "partner-a/shapes/red.png"]
    # THEN it needed neither the stack's outputs nor the table, which the partner may not read
    session = a.session()
    with pytest.raises(ClientError, match="AccessDenied"):
        session.client("cloudformation", endpoint_url=a.profile.endpoint_url).describe_stacks(StackName="atelier")
    with pytest.raises(ClientError, match="AccessDenied"):
        session.client("dynamodb", endpoint_url=a.profile.endpoint_url).get_item(
            TableName=enforced.stack.outputs["PipelineTableName"], Key={"pk": {"S": "PARTNER#partner-a"}})


def test_partner_a_writes_reads_lists_and_deletes_under_its_prefix_and_under_b_s_does_none(
        enforced: Enforced, catalog: Path, tmp_path: Path) -> None:
    # GIVEN B's upload, made with B's own profile and credentials
    b = enforced.partners["partner-b"]
    assert atelier("upload", "--profile", str(b.profile_path), str(catalog), env=b.env(tmp_path)).returncode == 0
    s3 = enforced.partners["partner-a"].session().client("s3", endpoint_url=b.profile.endpoint_url)
    bucket = enforced.uploads

    # under its own prefix: all four
    s3.put_object(Bucket=bucket, Key="partner-a/own.png", Body=b"a's")
    assert s3.get_object(Bucket=bucket, Key="partner-a/own.png")["Body"].read() == b"a's"
    assert "partner-a/own.png" in [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="partner-a/")["Contents"]]
    s3.delete_object(Bucket=bucket, Key="partner-a/own.png")
    # under B's: none
    assert denied(s3.put_object, Bucket=bucket, Key="partner-b/shapes/red.png", Body=b"forged")
    assert denied(s3.get_object, Bucket=bucket, Key="partner-b/shapes/red.png")
    assert denied(s3.list_objects_v2, Bucket=bucket, Prefix="partner-b/")
    assert denied(s3.list_objects_v2, Bucket=bucket)
    assert denied(s3.delete_object, Bucket=bucket, Key="partner-b/shapes/red.png")
    # THEN B's upload is as B left it
    theirs = enforced.admin("s3").get_object(Bucket=bucket, Key="partner-b/shapes/red.png")["Body"].read()
    assert theirs == (catalog / "shapes" / "red.png").read_bytes()


def test_partner_a_obtains_none_of_b_s_bytes_by_a_request_that_reads_one_object_to_write_another(
        enforced: Enforced, catalog: Path, tmp_path: Path) -> None:
    # GIVEN B's upload, and A's session, which may write (and so copy into) its own prefix
    b = enforced.partners["partner-b"]
    assert atelier("upload", "--profile", str(b.profile_path), str(catalog), env=b.env(tmp_path)).returncode == 0
    s3 = enforced.partners["partner-a"].session().client("s3", endpoint_url=b.profile.endpoint_url)
    bucket, theirs = enforced.uploads, "partner-b/shapes/red.png"
    source = {"Bucket": bucket, "Key": theirs}
    version = enforced.admin("s3").head_object(Bucket=bucket, Key=theirs)["VersionId"]
    upload = s3.create_multipart_upload(Bucket=bucket, Key="partner-a/copied.png")["UploadId"]

    # WHEN A copies B's object into its own prefix, whole, by version, or as a part of its own upload
    assert denied(s3.copy_object, Bucket=bucket, Key="partner-a/copied.png", CopySource=source)
    assert denied(s3.copy_object, Bucket=bucket, Key="partner-a/copied.png", CopySource={**source, "VersionId": version})
    assert denied(s3.upload_part_copy, Bucket=bucket, Key="partner-a/copied.png", UploadId=upload, PartNumber=1,
                  CopySource=source)
    # nor does it read B's object through a query or a restore
    assert denied(s3.select_object_content, Bucket=bucket, Key=theirs, ExpressionType="SQL",
                  Expression="SELECT * FROM S3Object", InputSerialization={"CSV": {}}, OutputSerialization={"CSV": {}})
    assert denied(s3.restore_object, Bucket=bucket, Key=theirs, RestoreRequest={"Days": 1})

    # THEN nothing of B's is under A's prefix: no object, no part
    assert s3.list_parts(Bucket=bucket, Key="partner-a/copied.png", UploadId=upload).get("Parts", []) == []
    s3.abort_multipart_upload(Bucket=bucket, Key="partner-a/copied.png", UploadId=upload)
    assert enforced.admin("s3").list_objects_v2(Bucket=bucket, Prefix="partner-a/copied")["KeyCount"] == 0


def test_another_partner_s_profile_is_no_use_with_a_s_credentials(enforced: Enforced, catalog: Path,
                                                                  tmp_path: Path) -> None:
    a, b = enforced.partners["partner-a"], enforced.partners["partner-b"]

    refused = atelier("upload", "--profile", str(b.profile_path), str(catalog), env=a.env(tmp_path))

    assert refused.returncode == 2, refused.stderr
    assert "AWS refused AssumeRole: AccessDenied" in refused.stderr
