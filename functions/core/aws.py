"""The only module that talks to boto3. Clients are made on first use, never at import.

Every client honours AWS_ENDPOINT_URL (and the per-service AWS_ENDPOINT_URL_<SERVICE>), so the
same code reaches real AWS or the local stack.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import tarfile
from typing import Any, Iterator

import boto3
from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.config import Config
from botocore.exceptions import ClientError, IncompleteReadError

_RETRIES = Config(retries={"max_attempts": 5, "mode": "standard"})
_serializer = TypeSerializer()
_deserializer = TypeDeserializer()


def client(service: str) -> Any:
    """A cached client, one per service and per endpoint/credential environment: a process whose
    environment changes (the local stack, the CLI's --local, tests) never reuses a stale one."""
    return _client(service, tuple(os.environ.get(name, "") for name in (
        "AWS_ENDPOINT_URL", f"AWS_ENDPOINT_URL_{service.upper().replace('-', '_')}", "AWS_DEFAULT_REGION",
        "AWS_REGION", "AWS_ACCESS_KEY_ID")))


@functools.cache
def _client(service: str, environment: tuple[str, ...]) -> Any:
    return boto3.client(service, config=_RETRIES)


def reset_clients() -> None:
    """Forget cached clients (moto's in-process mock must patch the ones tests use)."""
    _client.cache_clear()
    transfer_client.cache_clear()


@functools.cache
def transfer_client() -> Any:
    """S3 for bulk bytes (the packer): no SHA-256 payload signing, checksums only where asked.

    On AWS (HTTPS) boto3 already skips payload signing for streaming S3 bodies; plain-HTTP
    endpoints (the local stack) would otherwise hash every byte once more just to sign it.
    Checksums are computed or validated only when an operation requires one or a caller asks for
    CRC32 (`checksum=True`): segment and shard bytes are covered end to end by the shard digest
    instead (docs/pack.md, "Integrity"). `max_pool_connections` keeps a connection per thread.
    """
    config = _RETRIES.merge(Config(s3={"payload_signing_enabled": False},
                                   request_checksum_calculation="when_required",
                                   response_checksum_validation="when_required",
                                   max_pool_connections=16))
    return boto3.client("s3", config=config)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


# --- S3 -----------------------------------------------------------------------------------------

def head_object(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return client("s3").head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in {"404", "NoSuchKey", "NotFound"}:
            return None
        raise


def read_object(bucket: str, key: str, max_bytes: int | None = None, version_id: str = "") -> bytes:
    """Read an object (that version of it, when given); with `max_bytes`, never more than that many
    bytes (a ranged GET)."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version_id:
        kwargs["VersionId"] = version_id
    if max_bytes is not None:
        kwargs["Range"] = f"bytes=0-{max_bytes - 1}"
    return client("s3").get_object(**kwargs)["Body"].read()


def read_json_if_exists(bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise


def write_object(bucket: str, key: str, body: bytes, content_type: str = "application/octet-stream") -> None:
    client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)


def tag_object(bucket: str, key: str, tags: dict[str, str]) -> None:
    """Replace an object's tags (quarantined uploads are tagged, so they are visible in S3)."""
    client("s3").put_object_tagging(Bucket=bucket, Key=key, Tagging={
        "TagSet": [{"Key": k, "Value": v[:256]} for k, v in tags.items()]})


# --- SQS and EventBridge -------------------------------------------------------------------------

def send_message(queue_url: str, body: str) -> None:
    client("sqs").send_message(QueueUrl=queue_url, MessageBody=body)


def queue_depth(queue_url: str, delayed: bool = False) -> int:
    """Messages waiting plus in flight (SQS's approximate counts), and delayed ones if asked."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    names += ["ApproximateNumberOfMessagesDelayed"] if delayed else []
    attributes = client("sqs").get_queue_attributes(QueueUrl=queue_url, AttributeNames=names)["Attributes"]
    return sum(int(attributes.get(name, 0)) for name in names)


def put_event(bus: str, source: str, detail_type: str, detail: str) -> None:
    response = client("events").put_events(
        Entries=[{"EventBusName": bus, "Source": source, "DetailType": detail_type, "Detail": detail}]
    )
    if response.get("FailedEntryCount"):
        raise RuntimeError(f"EventBridge rejected the event: {response['Entries']}")


# --- DynamoDB -----------------------------------------------------------------------------------

def _to_item(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _serializer.serialize(v) for k, v in values.items() if v is not None}


def _from_item(item: dict[str, Any]) -> dict[str, Any]:
    return {k: _deserializer.deserialize(v) for k, v in item.items()}


def get_item(table: str, pk: str) -> dict[str, Any] | None:
    item = client("dynamodb").get_item(TableName=table, Key=_to_item({"pk": pk}), ConsistentRead=True).get("Item")
    return _from_item(item) if item else None


def put_item(table: str, item: dict[str, Any]) -> None:
    client("dynamodb").put_item(TableName=table, Item=_to_item(item))


def put_item_if_absent(table: str, item: dict[str, Any]) -> bool:
    """Create-only write; False when an item with that key already exists."""
    try:
        client("dynamodb").put_item(
            TableName=table, Item=_to_item(item), ConditionExpression="attribute_not_exists(pk)"
        )
        return True
    except ClientError as exc:
        if error_code(exc) == "ConditionalCheckFailedException":
            return False
        raise


def update_item(table: str, pk: str, update: str, values: dict[str, Any], condition: str | None = None,
                names: dict[str, str] | None = None) -> bool:
    """Update one item; False when `condition` does not hold."""
    kwargs: dict[str, Any] = {
        "TableName": table, "Key": _to_item({"pk": pk}), "UpdateExpression": update,
        "ExpressionAttributeValues": _to_item(values),
    }
    if condition:
        kwargs["ConditionExpression"] = condition
    if names:
        kwargs["ExpressionAttributeNames"] = names
    try:
        client("dynamodb").update_item(**kwargs)
        return True
    except ClientError as exc:
        if error_code(exc) == "ConditionalCheckFailedException":
            return False
        raise


def query_index(table: str, index: str, partition: str) -> list[dict[str, Any]]:
    """Every item of one GSI partition, in sort-key order."""
    paginator = client("dynamodb").get_paginator("query")
    items: list[dict[str, Any]] = []
    for page in paginator.paginate(
        TableName=table, IndexName=index, KeyConditionExpression="gsi1pk = :p",
        ExpressionAttributeValues={":p": {"S": partition}},
    ):
        items.extend(_from_item(i) for i in page["Items"])
    return items


def scan(table: str, **filters: Any) -> Iterator[dict[str, Any]]:
    """Every item of the table (or those `filters` select), page by page."""
    for page in client("dynamodb").get_paginator("scan").paginate(TableName=table, **filters):
        yield from (_from_item(i) for i in page["Items"])


def scan_prefix(table: str, prefix: str) -> list[dict[str, Any]]:
    return list(scan(table, FilterExpression="begins_with(pk, :p)", ExpressionAttributeValues={":p": {"S": prefix}}))


def _names_used(names: dict[str, str] | None, expression: str) -> dict[str, Any]:
    """DynamoDB refuses attribute names an expression does not use: pass each item only its own."""
    used = {k: v for k, v in (names or {}).items() if re.search(re.escape(k) + r"(?![A-Za-z0-9_])", expression)}
    return {"ExpressionAttributeNames": used} if used else {}


def transact_updates(table: str, updates: list[tuple[str, str, str, dict[str, Any]]],
                     puts: list[dict[str, Any]], names: dict[str, str] | None = None) -> bool:
    """All-or-nothing: conditional updates (pk, update, condition, values) and create-only puts.

    False when any condition fails (another invocation got there first).
    """
    items: list[dict[str, Any]] = [
        {"Update": {"TableName": table, "Key": _to_item({"pk": pk}), "UpdateExpression": update,
                    "ConditionExpression": condition, "ExpressionAttributeValues": _to_item(values),
                    **_names_used(names, update + " " + condition)}}
        for pk, update, condition, values in updates
    ]
    items += [
        {"Put": {"TableName": table, "Item": _to_item(item), "ConditionExpression": "attribute_not_exists(pk)"}}
        for item in puts
    ]
    try:
        client("dynamodb").transact_write_items(TransactItems=items)
        return True
    except ClientError as exc:
        if error_code(exc) == "TransactionCanceledException":
            return False
        raise


# --- SageMaker ----------------------------------------------------------------------------------

class ServiceQuotaExceeded(RuntimeError):
    """CreateTrainingJob's ResourceLimitExceeded: the account's quota for the instance type is used up."""


def create_training_job(request: dict[str, Any]) -> bool:
    """Start a job; False when a job of that name exists already (a redelivered event)."""
    try:
        client("sagemaker").create_training_job(**request)
        return True
    except ClientError as exc:
        if error_code(exc) == "ResourceInUse":
            return False
        if error_code(exc) == "ResourceLimitExceeded":
            raise ServiceQuotaExceeded(f"ResourceLimitExceeded: {exc.response['Error'].get('Message', '')}") from exc
        raise


def sagemaker_exists(kind: str, name: str) -> bool:
    """Whether a Model / EndpointConfig / Endpoint of that name exists."""
    describe = getattr(client("sagemaker"), f"describe_{kind}")
    try:
        describe(**{f"{''.join(p.title() for p in kind.split('_'))}Name": name})
        return True
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return False
        raise


def describe_endpoint(name: str) -> dict[str, Any] | None:
    try:
        return client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return None
        raise


def sagemaker_call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
    return getattr(client("sagemaker"), operation)(**request)


def describe_training_job(name: str) -> dict[str, Any] | None:
    try:
        return client("sagemaker").describe_training_job(TrainingJobName=name)
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return None
        raise


def sagemaker_tags(arn: str) -> dict[str, str]:
    tags: dict[str, str] = {}
    for page in client("sagemaker").get_paginator("list_tags").paginate(ResourceArn=arn):
        tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
    return tags


def read_tar_member(uri: str, member: str, max_bytes: int = 16 * 2**20) -> bytes:
    """One small member of a (gzipped) tar in S3, read as a stream: a model artefact is not loaded whole."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body = client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    with tarfile.open(fileobj=body, mode="r|*") as archive:
        for info in archive:
            if info.isfile() and info.name.removeprefix("./") == member:
                if info.size > max_bytes:
                    raise ValueError(f"{uri}:{member} is {info.size} bytes, over {max_bytes}")
                extracted = archive.extractfile(info)
                return extracted.read() if extracted else b""
    raise FileNotFoundError(f"{uri} has no member {member}")


def register_scalable_target(resource_id: str, minimum: int, maximum: int) -> None:
    client("application-autoscaling").register_scalable_target(
        ServiceNamespace="sagemaker", ResourceId=resource_id,
        ScalableDimension="sagemaker:variant:DesiredInstanceCount", MinCapacity=minimum, MaxCapacity=maximum)


def put_target_tracking_policy(resource_id: str, name: str, target: float) -> None:
    client("application-autoscaling").put_scaling_policy(
        PolicyName=name, ServiceNamespace="sagemaker", ResourceId=resource_id,
        ScalableDimension="sagemaker:variant:DesiredInstanceCount", PolicyType="TargetTrackingScaling",
        TargetTrackingScalingPolicyConfiguration={
            "TargetValue": target,
            "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
            "ScaleInCooldown": 300, "ScaleOutCooldown": 60})


# --- S3 streaming and multipart (the pack stage) -------------------------------------------------

class UploadGone(RuntimeError):
    """A multipart upload no longer exists (completed or aborted)."""


def _multipart_call(operation: str, **kwargs: Any) -> dict[str, Any]:
    try:
        return getattr(transfer_client(), operation)(**kwargs)
    except ClientError as exc:
        if error_code(exc) == "NoSuchUpload":
            raise UploadGone(f"{kwargs.get('Key')}: upload {kwargs.get('UploadId')} is gone") from exc
        raise


def open_object(bucket: str, key: str, version_id: str = "") -> tuple[int, "Download"]:
    """(size, stream) of an object, of exactly `version_id` when given."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, **({"VersionId": version_id} if version_id else {})}
    response = transfer_client().get_object(**kwargs)
    size = int(response["ContentLength"])
    return size, Download(response["Body"], size)


class Download:
    """An object's body whose `readinto` puts the bytes straight into the caller's buffer.

    botocore's `StreamingBody.readinto` goes through urllib3's, which reads into a new bytes
    object and copies it over. When an http.client response lies underneath (a real connection;
    moto's in-process mock has none), it is read directly: socket -> buffer, and the connection
    goes back to the pool once the body is read whole, as urllib3 does. Use `read` or `readinto`,
    not both.
    """

    def __init__(self, body: Any, size: int) -> None:
        self.body, self.size, self.left = body, size, size
        raw = getattr(body, "_raw_stream", None)
        direct = getattr(raw, "_fp", None)
        self.direct = direct if isinstance(direct, http.client.HTTPResponse) and hasattr(raw, "release_conn") \
            else None

    def readinto(self, buffer: memoryview) -> int:
        if self.direct is None:
            return int(self.body.readinto(buffer))
        count = self.direct.readinto(buffer[:self.left]) if self.left and len(buffer) else 0
        if not count and self.left and len(buffer):  # what StreamingBody raises on a short body
            raise IncompleteReadError(actual_bytes=self.size - self.left, expected_bytes=self.size)
        self.left -= count
        if not self.left:
            self.body._raw_stream.release_conn()
        return count

    def read(self, size: int = -1) -> bytes:
        return bytes(self.body.read(None if size < 0 else size))

    def close(self) -> None:
        self.body.close()

    def __enter__(self) -> "Download":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_range(bucket: str, key: str, start: int, end: int, version_id: str = "") -> bytes:
    """Bytes [start, end) of an object."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}",
                              **({"VersionId": version_id} if version_id else {})}
    return transfer_client().get_object(**kwargs)["Body"].read()


def put_bytes(bucket: str, key: str, body: bytes, content_type: str, checksum: bool = True) -> str:
    """Write a whole object; returns its version id ("" in an unversioned bucket)."""
    response = transfer_client().put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type,
                                            **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    return str(response.get("VersionId", ""))


def create_multipart(bucket: str, key: str, content_type: str, metadata: dict[str, str] | None = None,
                     checksum: bool = True) -> str:
    response = transfer_client().create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=metadata or {},
        **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    return str(response["UploadId"])


class _PartBody:
    """A part's bytes as the stream botocore sends: reads of a size are views of the caller's buffer,
    so urllib3 hands them to the socket without a copy (a `bytes` body is copied into a BytesIO and
    read back a block at a time). Seekable, so a retried request starts again from the top."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(data)
        self.position = 0

    def read(self, size: int | None = -1) -> bytes | memoryview:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.position + size)
        chunk = self.view[self.position:end]
        self.position = end
        return chunk if size is not None and size >= 0 else bytes(chunk)  # read(): a whole copy (moto's mock)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = max(0, min(len(self.view), offset + (0, self.position, len(self.view))[whence]))
        return self.position

    def tell(self) -> int:
        return self.position


def upload_part(bucket: str, key: str, upload_id: str, number: int, body: bytes | bytearray | memoryview,
                checksum: bool = True) -> dict[str, Any]:
    """Upload one part; returns its entry for `complete_multipart`. `body` is sent from where it
    lies (no copy) and must not change until this returns."""
    response = _multipart_call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                               Body=_PartBody(body), **({"ChecksumAlgorithm": "CRC32"} if checksum else {}))
    part = {"PartNumber": number, "ETag": response["ETag"]}
    if checksum:
        part["ChecksumCRC32"] = response["ChecksumCRC32"]
    return part


def upload_part_copy(bucket: str, key: str, upload_id: str, number: int, source_key: str, source_version: str,
                     start: int, end: int) -> dict[str, Any]:
    """Copy bytes [start, end) of another object of the bucket into a part, server-side."""
    source: dict[str, str] = {"Bucket": bucket, "Key": source_key, **({"VersionId": source_version}
                                                                       if source_version else {})}
    response = _multipart_call("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                               CopySource=source, CopySourceRange=f"bytes={start}-{end - 1}")
    return {"PartNumber": number, "ETag": response["CopyPartResult"]["ETag"]}


def complete_multipart(bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]]) -> str:
    """Complete an upload; returns the object's version id."""
    response = _multipart_call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                               MultipartUpload={"Parts": parts})
    return str(response.get("VersionId", ""))


def abort_multipart(bucket: str, key: str, upload_id: str) -> None:
    try:
        _multipart_call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except UploadGone:
        pass


def delete_object(bucket: str, key: str, version_id: str = "") -> None:
    """Delete an object, or exactly one version of it (which removes it for good)."""
    transfer_client().delete_object(Bucket=bucket, Key=key, **({"VersionId": version_id} if version_id else {}))


def batch_get_items(table: str, pks: list[str], attributes: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Consistent reads of many items by `pk` (100 per request); absent items are left out."""
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(pks), 100):
        request: dict[str, Any] = {table: {"Keys": [_to_item({"pk": pk}) for pk in dict.fromkeys(pks[start:start + 100])],
                                           "ConsistentRead": True}}
        if attributes:
            request[table]["ProjectionExpression"] = ", ".join(f"#a{i}" for i in range(len(attributes)))
            request[table]["ExpressionAttributeNames"] = {f"#a{i}": a for i, a in enumerate(attributes)}
        while request:
            response = client("dynamodb").batch_get_item(RequestItems=request)
            for item in response.get("Responses", {}).get(table, []):
                value = _from_item(item)
                found[value["pk"]] = value
            request = response.get("UnprocessedKeys") or {}
    return found


# --- listing (the audit and the sweep) -----------------------------------------------------------

def list_objects(bucket: str, prefix: str = "") -> Iterator[dict[str, Any]]:
    """Every current object under `prefix`: Key, Size, ETag, LastModified, page by page."""
    for page in client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def version_with_etag(bucket: str, key: str, etag: str) -> str:
    """The id of the version of `key` whose ETag is `etag` (a deleted object's versions remain), or ""."""
    if not etag:
        return ""
    pages = client("s3").get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key)
    return next((v["VersionId"] for page in pages for v in page.get("Versions", [])
                 if v["Key"] == key and str(v.get("ETag", "")).strip('"') == etag), "")


def read_prefix_with_etag(bucket: str, key: str, max_bytes: int) -> tuple[bytes, str] | None:
    """At most the first `max_bytes` of an object and its ETag (one ranged GET); None when it does not exist."""
    try:
        response = client("s3").get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max_bytes - 1}")
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise
    return response["Body"].read(), str(response.get("ETag", "")).strip('"')


def read_prefix_if_exists(bucket: str, key: str, max_bytes: int) -> bytes | None:
    """At most the first `max_bytes` of an object (one ranged GET); None when it does not exist."""
    try:
        return read_object(bucket, key, max_bytes=max_bytes)
    except ClientError as exc:
        if error_code(exc) in {"NoSuchKey", "404"}:
            return None
        raise
