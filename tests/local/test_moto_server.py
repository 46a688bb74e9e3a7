"""atelier.local.moto_server: DynamoDB requests one at a time, everything else concurrently."""

from __future__ import annotations

import threading
import time
from typing import Any

from atelier.local.moto_server import SerialDynamoDB


def slow_app(log: list[str], seconds: float = 0.05):
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        name = environ["name"]
        log.append(f"start {name}")
        time.sleep(seconds)
        log.append(f"end {name}")
        return [b"ok"]
    return app


def call_together(app: Any, environs: list[dict[str, Any]]) -> None:
    threads = [threading.Thread(target=lambda e=e: app(e, lambda *a: None)) for e in environs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_dynamodb_requests_never_overlap() -> None:
    log: list[str] = []
    calls = [{"name": str(i), "HTTP_X_AMZ_TARGET": "DynamoDB_20120810.TransactWriteItems"} for i in range(4)]

    call_together(SerialDynamoDB(slow_app(log)), calls)

    assert all(log[i].startswith("start") and log[i + 1] == log[i].replace("start", "end")
               for i in range(0, len(log), 2))


def test_other_requests_still_run_side_by_side() -> None:
    log: list[str] = []
    calls = [{"name": str(i), "HTTP_X_AMZ_TARGET": "AmazonSQS.ReceiveMessage"} for i in range(4)]

    call_together(SerialDynamoDB(slow_app(log, seconds=0.2)), calls)

    # every request started before the first one ended
    assert all(entry.startswith("start") for entry in log[:4])
