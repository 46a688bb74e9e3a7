"""Four IAM rules moto's enforcement leaves out, applied on the local stack as AWS applies them.

1. `s3:prefix` on S3 listings. moto's IAM enforcement matches a policy's Action and Resource, but
gives an identity policy's conditions no request context, so every condition counts as met. For
listings that matters: S3 authorises ListObjects on the bucket ARN, and the `s3:prefix` condition
key is the only way a policy limits which keys a principal may list (S3 User Guide, "Bucket policy
examples using condition keys"; IAM User Guide, "Amazon S3: Allows IAM users access to their S3
home directory"). Without this, a partner role allowed `s3:ListBucket` with `StringLike s3:prefix
partner-a/*` lists partner-b/ here, which AWS refuses.

For the listing actions below the caller's policies are decided here, by IAM's rules: an explicit
Deny wins, then any Allow, else denied; a statement applies when its Action, Resource and every
condition match; a key absent from the request fails its condition, except for the negated
operators (`StringNotLike`...) and `...IfExists`, where it passes (IAM User Guide, "Condition
operators"). `s3:prefix` is the request's `prefix` parameter, absent when none is sent. The
string operators are modelled; another operator on `s3:prefix` is refused (stricter than AWS,
never looser). Conditions on other keys count as met, as in moto; policy variables are not
substituted, as in moto. Every other request is moto's as before.

2. AssumeRole of a role that does not exist. moto checks a role's trust policy only when the role
exists, so a caller allowed `sts:AssumeRole` gets credentials for a deleted role; AWS refuses
(AccessDenied): a partner whose role was removed can no longer start a session.

3. Both objects of a copy. A request with `x-amz-copy-source` (CopyObject, UploadPartCopy) reads
one object to write another: AWS authorises it on both, `s3:GetObject` on the source
(`s3:GetObjectVersion` when it names a version) and `s3:PutObject` on the destination (S3 API
reference, CopyObject and UploadPartCopy, "Permissions"). moto checks the destination alone, so a
partner allowed to write its own prefix could copy another partner's upload, or a shard, into it
and read it back. Here a request that carries the header is refused unless the caller's policies
allow reading the source and putting the destination, besides moto's own check (any request, with
the source parsed as moto parses it to copy, and refused when it names no object). The other
requests a partner role could send each touch the one object they name (SelectObjectContent,
RestoreObject) or are refused by moto outright (DeleteObjects; docs/aws-differences.md).

4. The IAM action of an S3 request. IAM authorises an S3 API operation as the action the S3 User
Guide lists for it ("Required permissions for Amazon S3 API operations"): ListObjectsV2 and
HeadBucket as `s3:ListBucket`, HeadObject as `s3:GetObject`, each multipart step as `s3:PutObject`,
GetObject of a version as `s3:GetObjectVersion`. moto 5.2.6 checks the operation's own name
(`s3:ListObjectsV2`), which no policy grants; earlier versions checked their own table. Here the
operation is named as IAM names it before any check; an operation absent from the table keeps its
name, and so is refused unless a policy grants that name (DeleteObjects, SelectObjectContent).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

LISTING_ACTIONS = frozenset({"s3:ListBucket", "s3:ListBucketVersions", "s3:ListBucketMultipartUploads"})
MODELLED_KEYS = frozenset({"s3:prefix"})
STRING_OPERATORS = {"StringEquals": lambda expected, value: expected == value,
                    "StringLike": lambda expected, value: _like(expected, value)}


COPY_SOURCE = "x-amz-copy-source"

# S3 API operation -> the IAM action that authorises it, where the two names differ
IAM_ACTIONS = {
    "ListObjects": "ListBucket", "ListObjectsV2": "ListBucket", "HeadBucket": "ListBucket",
    "ListObjectVersions": "ListBucketVersions", "ListMultipartUploads": "ListBucketMultipartUploads",
    "ListParts": "ListMultipartUploadParts", "ListBuckets": "ListAllMyBuckets",
    "HeadObject": "GetObject", "CopyObject": "PutObject", "CreateMultipartUpload": "PutObject",
    "UploadPart": "PutObject", "UploadPartCopy": "PutObject", "CompleteMultipartUpload": "PutObject",
    "PutBucketEncryption": "PutEncryptionConfiguration", "GetBucketEncryption": "GetEncryptionConfiguration",
    "PutBucketLifecycleConfiguration": "PutLifecycleConfiguration",
    "GetBucketLifecycleConfiguration": "GetLifecycleConfiguration", "DeleteBucketLifecycle": "PutLifecycleConfiguration",
    "PutBucketNotificationConfiguration": "PutBucketNotification",
    "GetBucketNotificationConfiguration": "GetBucketNotification",
    "PutPublicAccessBlock": "PutBucketPublicAccessBlock", "GetPublicAccessBlock": "GetBucketPublicAccessBlock",
    "DeletePublicAccessBlock": "PutBucketPublicAccessBlock",
    "PutBucketCors": "PutBucketCORS", "GetBucketCors": "GetBucketCORS", "DeleteBucketCors": "PutBucketCORS",
}
# reads and deletes of one version are actions of their own
VERSION_ACTIONS = {"GetObject": "GetObjectVersion", "DeleteObject": "DeleteObjectVersion",
                   "GetObjectTagging": "GetObjectVersionTagging", "PutObjectTagging": "PutObjectVersionTagging"}


def iam_action(action: str, path: str) -> str:
    """The IAM action (`s3:...`) that authorises the S3 request moto names `action`, at this path and query."""
    name = action.removeprefix("s3:")
    name = IAM_ACTIONS.get(name, name)
    if name in VERSION_ACTIONS and "versionId" in parse_qs(urlparse(path).query, keep_blank_values=True):
        name = VERSION_ACTIONS[name]
    return f"s3:{name}"


def copy_source_read(header: str, partition: str) -> tuple[str, str] | None:
    """The action and object ARN that reading a copy's source takes; None when it names no object.
    Parsed as moto parses it to copy: `bucket/key`, URL-encoded, `?versionId=` for a version."""
    parsed = urlparse(header)
    bucket, _, key = unquote(parsed.path).lstrip("/").partition("/")
    if not bucket or not key:
        return None
    action = "s3:GetObjectVersion" if "versionId" in parse_qs(parsed.query) else "s3:GetObject"
    return action, f"arn:{partition}:s3:::{bucket}/{key}"


def copy_allowed(documents: list[dict[str, Any]], header: str, destination: str) -> bool:
    """Whether policies with these documents allow a copy from the header's source to `destination`."""
    source = copy_source_read(header, destination.split(":")[1])
    return (source is not None and allowed(documents, *source, {})
            and allowed(documents, "s3:PutObject", destination, {}))


def request_context(path: str) -> dict[str, str]:
    """The modelled condition keys of a listing request (path with its query string)."""
    query = parse_qs(urlparse(path).query, keep_blank_values=True)
    return {"s3:prefix": query["prefix"][0]} if "prefix" in query else {}


def allowed(documents: Iterable[dict[str, Any]], action: str, resource: str, context: dict[str, str]) -> bool:
    """Whether policies with these documents allow the request."""
    permitted = False
    for statement in (s for document in documents for s in _listed(document.get("Statement", []))):
        if not _applies(statement, action, resource, context):
            continue
        if statement.get("Effect") == "Deny":
            return False
        permitted = permitted or statement.get("Effect") == "Allow"
    return permitted


def _applies(statement: dict[str, Any], action: str, resource: str, context: dict[str, str]) -> bool:
    return (_element_matches(statement, "Action", action, ignore_case=True)
            and _element_matches(statement, "Resource", resource)
            and all(_condition_met(operator, key, _listed(expected), context)
                    for operator, keys in statement.get("Condition", {}).items() for key, expected in keys.items()))


def _element_matches(statement: dict[str, Any], element: str, value: str, ignore_case: bool = False) -> bool:
    if element in statement:
        return any(_like(pattern, value, ignore_case) for pattern in _listed(statement[element]))
    if f"Not{element}" in statement:
        return not any(_like(pattern, value, ignore_case) for pattern in _listed(statement[f"Not{element}"]))
    return False


def _condition_met(operator: str, key: str, expected: list[Any], context: dict[str, str]) -> bool:
    key = key.lower()
    if key not in MODELLED_KEYS:
        return True  # as moto: a key it has no value for counts as met
    if_exists = operator.endswith("IfExists")
    base = operator.removesuffix("IfExists")
    negated = base.startswith("StringNot")
    compare = STRING_OPERATORS.get(base.replace("StringNot", "String", 1))
    if compare is None:
        return False  # not modelled here: refused rather than guessed
    if key not in context:
        return if_exists or negated
    hit = any(compare(str(value), context[key]) for value in expected)
    return not hit if negated else hit


def _like(pattern: str, value: str, ignore_case: bool = False) -> bool:
    """IAM's wildcards: `*` any run of characters, `?` one character."""
    regex = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(regex, value, re.DOTALL | (re.IGNORECASE if ignore_case else 0)) is not None


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def patch_iam_rules() -> None:
    """Apply the three rules of the module docstring to moto's IAM enforcement (once)."""
    from moto.iam.access_control import IAMPolicy, IAMRequest, S3IAMRequest
    from moto.iam.exceptions import NotFoundException

    s3_check = S3IAMRequest.check_action_permitted
    if getattr(s3_check, "patched", False):
        return

    def documents(request: S3IAMRequest) -> list[dict[str, Any]]:
        return [IAMPolicy(policy)._policy_json for policy in request._access_key.collect_policies()]

    def check_s3(self: S3IAMRequest, resource: str) -> None:
        self._action = iam_action(self._action, self._path)
        header = next((value for name, value in self._headers.items() if name.lower() == COPY_SOURCE), None)
        if header is not None and not copy_allowed(documents(self), str(header), resource):
            self._raise_access_denied()
        if self._action not in LISTING_ACTIONS:
            return s3_check(self, resource)
        if not allowed(documents(self), self._action, resource, request_context(self._path)):
            self._raise_access_denied()
        return None

    assume_check = IAMRequest.check_action_permitted

    def check_assume_role(self: IAMRequest, resource: str) -> None:
        if self._action == "sts:AssumeRole":
            try:
                self.backend.get_role_by_arn(resource)
            except NotFoundException:
                self._raise_access_denied()
        return assume_check(self, resource)

    check_s3.patched = True  # type: ignore[attr-defined]
    S3IAMRequest.check_action_permitted = check_s3  # type: ignore[method-assign]
    IAMRequest.check_action_permitted = check_assume_role  # type: ignore[method-assign]
