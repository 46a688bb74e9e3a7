"""Uploads delivered to IngestFunction's handler through UploadsQueue, as Lambda would."""

from __future__ import annotations

from typing import Any

import boto3

from atelier.local.provision import Provisioned
from atelier.local.runtime import sqs_event


def ingest_through_queue(stack: Provisioned, handler: Any, context: Any, uploads: dict[str, bytes]) -> dict:
    """Put the objects, then hand every notification UploadsQueue got to the handler in one batch."""
    s3, sqs = boto3.client("s3"), boto3.client("sqs")
    for key, body in uploads.items():
        s3.put_object(Bucket=stack.outputs["UploadsBucketName"], Key=key, Body=body)
    url, messages = stack.outputs["UploadsQueueUrl"], []
    while batch := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages"):
        messages += [m for m in batch if "s3:TestEvent" not in m["Body"]]
        sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                        for i, m in enumerate(batch)])
    source = next(s for s in stack.sources if s.function == "IngestFunction")
    return handler(sqs_event(messages, source, "us-east-1"), context)
