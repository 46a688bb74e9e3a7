"""A partner's own upload role and the profile that points the partner at it (docs/reliability.md,
"Partner isolation").

Every registered partner given `--principal` gets one IAM role, generated from its registry entry
by `atelier partner add`. The role's policy names the partner's prefix literally, with no policy
variable: IAM matches its Resource ARNs on AWS, and moto with IAM enforcement matches the same
ARNs locally (moto substitutes no `${aws:...}` variable, so a policy written with one would grant
nothing there). Listing is the one rule a Resource cannot hold: S3 authorises ListObjects on the
bucket, and only the `s3:prefix` condition limits which keys a principal lists (S3 User Guide,
"Bucket policy examples using condition keys"); the local stack evaluates that key
(atelier/local/iam_rules.py). template.yaml's PartnerBoundary caps every such role at the
uploads bucket; PartnerAdminPolicy lets an operator make them only under ROLE_PATH, with it.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from typing import Any

from pydantic import Field, ValidationError, model_validator

from contracts import job_tags
from contracts.messages import Frozen
from core.ingest.uploads import PARTNER_PATTERN

ROLE_PATH = "/atelier/partners/"  # template.yaml's PartnerAdminPolicy names it
ROLE_POLICY_NAME = "atelier-partner-uploads"
ROLE_MAX_SESSION_S = 3600  # IAM's default MaxSessionDuration; the CLI refreshes before expiry
PARTNER_TAG = job_tags.PARTNER
# Whom a role may trust: an IAM role or user (a partner's own, in its account, or a broker's).
# Not an account root: that hands the choice to whoever administers that account.
PRINCIPAL_PATTERN = r"^arn:aws[a-z-]*:iam::[0-9]{12}:(role|user)/[A-Za-z0-9_+=,.@/-]+$"
ROLE_ARN_PATTERN = r"^arn:aws[a-z-]*:iam::[0-9]{12}:role/[A-Za-z0-9_+=,.@/-]+$"
OBJECT_ACTIONS = ("s3:PutObject", "s3:GetObject", "s3:DeleteObject",
                  "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts")
LIST_ACTION = "s3:ListBucket"
KMS_ACTIONS = ("kms:Decrypt", "kms:GenerateDataKey")  # SSE-KMS: a PUT makes a data key, multipart decrypts it
IAM_NAME_MAX = 64


class AccessError(ValueError):
    """A partner role or profile that cannot be made or read; the message says why."""


def prefix_of(partner_id: str) -> str:
    """The key prefix a partner uploads under: `<id>/`, a folder (so `acme` never reaches `acme-2/`)."""
    if not PARTNER_PATTERN.fullmatch(partner_id):
        raise AccessError(f"partner id {partner_id!r} must be lower-case letters, digits and '-' (at most 64)")
    return f"{partner_id}/"


def role_name(stack: str, partner_id: str) -> str:
    """`<stack>-partner-<id>`; past IAM's 64 characters, cut and ended with a hash of the whole."""
    prefix_of(partner_id)
    head = f"{stack}-partner-"
    if len(head) > IAM_NAME_MAX - 9 - 1:
        raise AccessError(f"stack name {stack!r} is too long to name partner roles (at most 45 characters)")
    name = head + partner_id
    if len(name) <= IAM_NAME_MAX:
        return name
    return f"{name[:IAM_NAME_MAX - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def session_name(partner_id: str) -> str:
    """What the partner's sessions are called in CloudTrail."""
    return f"atelier-upload-{partner_id}"[:IAM_NAME_MAX]


def check_principals(principals: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The principals, each an IAM role or user ARN, without repeats; AccessError naming a bad one."""
    for principal in principals:
        if not re.fullmatch(PRINCIPAL_PATTERN, principal):
            raise AccessError(f"--principal {principal!r} must be an IAM role or user ARN "
                              "(arn:aws:iam::<account>:role/NAME or :user/NAME)")
    return tuple(dict.fromkeys(principals))


def trust_policy(principals: tuple[str, ...]) -> dict[str, Any]:
    """Only these principals may assume the role (they also need sts:AssumeRole on it in their own account)."""
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"AWS": list(check_principals(principals))}, "Action": "sts:AssumeRole"}]}


def role_policy(partition: str, bucket: str, partner_id: str, kms_key_arn: str = "") -> dict[str, Any]:
    """Put, get and delete objects under the partner's prefix, list only that prefix, nothing else."""
    prefix = prefix_of(partner_id)
    statements: list[dict[str, Any]] = [
        {"Sid": "OwnPrefixObjects", "Effect": "Allow", "Action": list(OBJECT_ACTIONS),
         "Resource": f"arn:{partition}:s3:::{bucket}/{prefix}*"},
        # ListObjects is authorised on the bucket: s3:prefix is what keeps the listing to its folder
        {"Sid": "OwnPrefixListing", "Effect": "Allow", "Action": LIST_ACTION,
         "Resource": f"arn:{partition}:s3:::{bucket}", "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}}},
    ]
    if kms_key_arn:
        statements.append({"Sid": "StorageKey", "Effect": "Allow", "Action": list(KMS_ACTIONS), "Resource": kms_key_arn})
    return {"Version": "2012-10-17", "Statement": statements}


# --- the partner profile ----------------------------------------------------------------------

class PartnerProfile(Frozen):
    """What a partner needs to upload (`atelier upload --profile`): where, and which role to assume."""

    partner: str = Field(pattern=f"^{PARTNER_PATTERN.pattern}$")
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str
    region: str = Field(min_length=1)
    role_arn: str = Field(pattern=ROLE_ARN_PATTERN, max_length=2048)
    endpoint_url: str = Field(default="", pattern=r"^(https?://\S+)?$")  # the local stack's; empty on AWS
    source_profile: str = ""  # the partner's AWS profile to assume the role with; empty: the default chain

    @model_validator(mode="after")
    def _prefix_is_the_partner_s(self) -> "PartnerProfile":
        if self.prefix != prefix_of(self.partner):
            raise ValueError(f"prefix must be {prefix_of(self.partner)!r}, the partner's folder")
        return self


def render_profile(profile: PartnerProfile, principals: tuple[str, ...]) -> str:
    """The profile as TOML, with comments that tell the partner how to use it. It holds no secret."""
    values = profile.model_dump()
    lines = [
        f"# Atelier partner profile for {profile.partner} (`atelier partner export {profile.partner}`).",
        "# Upload with: atelier upload --profile partner.toml PATH",
        "# No secret here: atelier assumes role_arn with your own AWS credentials (your usual AWS",
        "# configuration, or the profile named by source_profile), as one of:",
        *(f"#   {principal}" for principal in principals),
        f"# The role may put, get, list and delete objects under s3://{profile.bucket}/{profile.prefix} only.",
    ]
    for key in ("partner", "bucket", "prefix", "region", "role_arn"):
        lines.append(f"{key} = {json.dumps(values[key])}")
    lines.append(f"source_profile = {json.dumps(values['source_profile'])}" if profile.source_profile
                 else '# source_profile = "your-aws-profile"')
    if profile.endpoint_url:
        lines += ["# the local stack's endpoint (a profile for AWS has none)",
                  f"endpoint_url = {json.dumps(profile.endpoint_url)}"]
    return "\n".join(lines) + "\n"


def read_profile(text: str) -> PartnerProfile:
    """A profile from its TOML; AccessError saying what is wrong with it."""
    try:
        return PartnerProfile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise AccessError(f"not TOML: {exc}") from exc
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "profile"
        raise AccessError(f"{where}: {error['msg']}") from exc
