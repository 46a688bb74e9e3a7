"""SQS: sending a message and reading a queue's depth."""

from __future__ import annotations

from core.aws import clients


def send_message(queue_url: str, body: str) -> None:
    clients.client("sqs").send_message(QueueUrl=queue_url, MessageBody=body)


def queue_depth(queue_url: str, delayed: bool = False) -> int:
    """Messages waiting plus in flight (SQS's approximate counts), and delayed ones if asked."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    names += ["ApproximateNumberOfMessagesDelayed"] if delayed else []
    attributes = clients.client("sqs").get_queue_attributes(QueueUrl=queue_url, AttributeNames=names)["Attributes"]
    return sum(int(attributes.get(name, 0)) for name in names)
