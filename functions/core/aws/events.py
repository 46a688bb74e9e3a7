"""EventBridge: putting one event on a bus."""

from __future__ import annotations

from core.aws import clients


def put_event(bus: str, source: str, detail_type: str, detail: str) -> None:
    response = clients.client("events").put_events(
        Entries=[{"EventBusName": bus, "Source": source, "DetailType": detail_type, "Detail": detail}]
    )
    if response.get("FailedEntryCount"):
        raise RuntimeError(f"EventBridge rejected the event: {response['Entries']}")
