"""Every AWS call the pipeline makes, one module per service; the only package that imports boto3.

Callers use the names re-exported here (`from core import aws; aws.read_object(...)`): clients.py
(clients made on first use, never at import), s3.py (objects), s3_transfer.py (the pack stage's bulk
bytes and multipart uploads), dynamodb.py, sqs.py, events.py (EventBridge), sagemaker.py (with the
endpoints' autoscaling). A test that patches one of these names here changes what callers of `aws.`
get; to change the client every module of the package uses, patch `aws.clients.client`.
"""

from typing import Any

from botocore.exceptions import ClientError, IncompleteReadError

from core.aws import clients
from core.aws.clients import error_code, reset_clients, transfer_client
from core.aws.dynamodb import (batch_get_items, get_item, put_item, put_item_if_absent, query_index, scan, scan_prefix,
                               transact_updates, update_item)
from core.aws.events import put_event
from core.aws.s3 import (copy_object, has_objects, head_object, list_objects, read_json_if_exists, read_object,
                         read_prefix_if_exists, read_prefix_with_etag, read_tar_member, tag_object, version_with_etag,
                         write_object, write_object_if_absent)
from core.aws.s3_transfer import (Download, UploadGone, abort_multipart, complete_multipart, create_multipart,
                                  delete_object, open_object, put_bytes, read_range, upload_part, upload_part_copy)
from core.aws.sagemaker import (ServiceQuotaExceeded, create_training_job, describe_endpoint, describe_training_job,
                                put_target_tracking_policy, register_scalable_target, sagemaker_call,
                                sagemaker_exists, sagemaker_tags, training_job_tags)
from core.aws.sqs import queue_depth, send_message


def client(service: str) -> Any:
    """clients.client, looked up when called: patching `aws.clients.client` reaches callers of this too."""
    return clients.client(service)


__all__ = [
    "ClientError", "Download", "IncompleteReadError", "ServiceQuotaExceeded", "UploadGone", "abort_multipart",
    "batch_get_items", "client", "clients", "complete_multipart", "copy_object", "create_multipart",
    "create_training_job", "delete_object", "describe_endpoint", "describe_training_job", "error_code", "get_item",
    "has_objects", "head_object", "list_objects",
    "open_object", "put_bytes", "put_event", "put_item", "put_item_if_absent", "put_target_tracking_policy",
    "query_index", "queue_depth", "read_json_if_exists", "read_object", "read_prefix_if_exists",
    "read_prefix_with_etag", "read_range", "read_tar_member", "register_scalable_target", "reset_clients",
    "sagemaker_call", "sagemaker_exists", "sagemaker_tags", "scan", "scan_prefix", "send_message", "tag_object",
    "training_job_tags", "transact_updates", "transfer_client", "update_item", "upload_part", "upload_part_copy",
    "version_with_etag",
    "write_object", "write_object_if_absent",
]
