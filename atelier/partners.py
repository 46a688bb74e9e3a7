"""Partner upload roles and profiles, through IAM and STS (core.partners.partner_access says what they hold).

The operator's side: `atelier partner add ID ... --principal ARN` makes (or updates, or removes) the
partner's role from its registry entry, and `atelier partner export ID` prints its profile. The
partner's side: `atelier upload --profile partner.toml` assumes the role with the partner's own
credentials and uploads with nothing else: no stack outputs, no table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import boto3
import botocore.session
from botocore.credentials import CredentialProvider, RefreshableCredentials

from atelier.client import PipelineError
from core.partners import partner_access as access
from core.partners.licensing import Partner, get_partner


def _checked(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except access.AccessError as exc:
        raise PipelineError(str(exc)) from exc


def _role_exists(iam: Any, name: str) -> bool:
    try:
        iam.get_role(RoleName=name)
        return True
    except iam.exceptions.NoSuchEntityException:
        return False


# --- the operator's side ------------------------------------------------------------------------

def update_role(stack: str, outputs: dict[str, str], partner_id: str, principals: list[str]) -> str | None:
    """Make the partner's role match `principals` (before its registry entry is written): created or
    updated when there are some, removed when there are none and an earlier entry had some. Its ARN, or None."""
    principals = list(_checked(lambda: access.check_principals(principals)))
    name = _checked(lambda: access.role_name(stack, partner_id))
    previous = get_partner(outputs["PipelineTableName"], partner_id)
    if not principals:
        if previous is not None and previous.principals:
            remove_role(name)
        return None  # a partner never given a role needs no IAM rights to register
    if "PartnerBoundaryArn" not in outputs:
        raise PipelineError(f"stack {stack!r} has no PartnerBoundaryArn output: deploy this version of template.yaml first")
    boundary = outputs["PartnerBoundaryArn"]
    policy = access.role_policy(boundary.split(":")[1], outputs["UploadsBucketName"], partner_id,
                                outputs.get("StorageKmsKeyArn", ""))
    trust = json.dumps(access.trust_policy(tuple(principals)))
    iam = boto3.client("iam")
    if _role_exists(iam, name):
        iam.update_assume_role_policy(RoleName=name, PolicyDocument=trust)
        iam.put_role_permissions_boundary(RoleName=name, PermissionsBoundary=boundary)
    else:
        iam.create_role(Path=access.ROLE_PATH, RoleName=name, AssumeRolePolicyDocument=trust,
                        PermissionsBoundary=boundary, MaxSessionDuration=access.ROLE_MAX_SESSION_S,
                        Description=f"Atelier partner {partner_id}: its own prefix of the uploads bucket",
                        Tags=[{"Key": access.PARTNER_TAG, "Value": partner_id}])
    iam.put_role_policy(RoleName=name, PolicyName=access.ROLE_POLICY_NAME, PolicyDocument=json.dumps(policy))
    return str(iam.get_role(RoleName=name)["Role"]["Arn"])


def remove_role(name: str) -> None:
    """The policy first (sessions already issued lose their rights: IAM evaluates per request), then the role."""
    iam = boto3.client("iam")
    for call in (lambda: iam.delete_role_policy(RoleName=name, PolicyName=access.ROLE_POLICY_NAME),
                 lambda: iam.delete_role(RoleName=name)):
        try:
            call()
        except iam.exceptions.NoSuchEntityException:
            pass


def export(stack: str, outputs: dict[str, str], partner_id: str) -> str:
    """The partner's profile (TOML) for `atelier upload --profile`: bucket, prefix, region, its role."""
    partner: Partner | None = get_partner(outputs["PipelineTableName"], partner_id)
    if partner is None:
        raise PipelineError(f"partner {partner_id!r} is not registered: `atelier partner add {partner_id} --license L "
                            "--principal ARN` first")
    if not partner.principals:
        raise PipelineError(f"partner {partner_id!r} has no upload role: give it one with `atelier partner add "
                            f"{partner_id} --license ... --principal ARN` (the IAM role or user it uploads as)")
    iam = boto3.client("iam")
    try:
        arn = iam.get_role(RoleName=_checked(lambda: access.role_name(stack, partner_id)))["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        raise PipelineError(f"partner {partner_id!r}'s upload role is missing: run `atelier partner add {partner_id}` "
                            "with its licenses and --principal again") from None
    profile = access.PartnerProfile(
        partner=partner_id, bucket=outputs["UploadsBucketName"], prefix=access.prefix_of(partner_id),
        region=boto3.session.Session().region_name or "", role_arn=arn,
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL", ""))
    return access.render_profile(profile, partner.principals)


# --- the partner's side -------------------------------------------------------------------------

def read_profile(path: Path) -> access.PartnerProfile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PipelineError(f"cannot read the partner profile {path}: {exc.strerror}") from exc
    try:
        return access.read_profile(text)
    except access.AccessError as exc:
        raise PipelineError(f"{path} is not a partner profile ({exc}): ask the operator for "
                            "`atelier partner export ID`'s output") from exc


class _PartnerRole(CredentialProvider):
    """The role's credentials, assumed again shortly before they expire (an upload may outlast one session)."""

    METHOD = "atelier-partner-role"

    def __init__(self, assume: Callable[[], dict[str, str]]) -> None:
        super().__init__()
        self._assume = assume

    def load(self) -> RefreshableCredentials:
        return RefreshableCredentials.create_from_metadata(self._assume(), self._assume, self.METHOD)


def partner_session(profile: access.PartnerProfile, base: boto3.Session | None = None) -> boto3.Session:
    """A session with the partner role's rights alone. `base` holds the credentials that assume it
    (default: the profile's source_profile, or the usual AWS chain)."""
    base = base or boto3.Session(profile_name=profile.source_profile or None)
    sts = base.client("sts", region_name=profile.region, endpoint_url=profile.endpoint_url or None)

    def assume() -> dict[str, str]:
        credentials = sts.assume_role(RoleArn=profile.role_arn, RoleSessionName=access.session_name(profile.partner),
                                      DurationSeconds=access.ROLE_MAX_SESSION_S)["Credentials"]
        return {"access_key": credentials["AccessKeyId"], "secret_key": credentials["SecretAccessKey"],
                "token": credentials["SessionToken"], "expiry_time": credentials["Expiration"].isoformat()}

    session = botocore.session.Session()
    session.get_component("credential_provider").insert_before("env", _PartnerRole(assume))
    session.get_credentials()  # assume now: a refused role fails here, before any file is read
    return boto3.Session(botocore_session=session, region_name=profile.region)


def s3_client(profile: access.PartnerProfile, base: boto3.Session | None = None) -> Any:
    return partner_session(profile, base).client("s3", endpoint_url=profile.endpoint_url or None)
