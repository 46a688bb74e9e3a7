"""One local "Lambda" process: polls a function's event sources and invokes its handler.

Each function runs in its own processes (one per concurrent execution environment, see
atelier/local/stack.py), with exactly the environment template.yaml gives it, as on Lambda:
`python -m atelier.local.worker STATE_FILE LOGICAL_ID [INSTANCE]`. Only instance 0 fires the
function's schedules, so a rate(1 minute) rule still fires once a minute.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import boto3

from atelier.local.chaos import CHAOS_ENV, GENERATION_ENV, Chaos, supervise
from atelier.local.provision import Provisioned
from atelier.local.runtime import Poller, load_handler

SCHEDULE_SCALE_ENV = "ATELIER_LOCAL_SCHEDULE_SCALE"
LONG_POLL_S = 20  # SQS's longest ReceiveMessage wait


def run(state_file: Path, logical_id: str, instance: int = 0) -> None:
    provisioned = Provisioned.from_json(json.loads(state_file.read_text())["provisioned"])
    spec = provisioned.functions[logical_id]
    os.environ.update(spec.environment)
    os.environ["AWS_LAMBDA_FUNCTION_NAME"] = spec.name
    chaos = Chaos.from_env(logical_id, instance)  # opt-in fault injection (tests/e2e/test_chaos.py)
    if chaos is not None:
        chaos.install()
    handler = load_handler(spec)
    if chaos is not None:
        handler = chaos.wrap(handler)
    sqs = boto3.client("sqs")
    schedule_scale = float(os.environ.get(SCHEDULE_SCALE_ENV, "1"))  # opt-in: faster timers in tests
    sources = [s for s in provisioned.sources if s.function == logical_id and (instance == 0 or not s.schedule_s)]
    # One source: wait on it as long as SQS allows (an idle worker then costs nothing). Several: a
    # long wait on one would hold back the others, so each waits a second.
    wait_s = LONG_POLL_S if len(sources) == 1 else 1
    pollers = [Poller(s, spec, handler, sqs, provisioned.region, provisioned.account, wait_s=wait_s,
                      schedule_scale=schedule_scale, chaos=chaos) for s in sources]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not any(poller.delivering for poller in pollers):
            raise SystemExit(0)  # idle, perhaps inside a long poll: nothing to finish
        stopping = True  # finish the delivery in flight, then leave

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        for poller in pollers:
            poller.poll_once()


if __name__ == "__main__":
    if os.environ.get(CHAOS_ENV) and GENERATION_ENV not in os.environ:
        sys.exit(supervise(["-m", "atelier.local.worker", *sys.argv[1:]]))  # restarts what a `kill` fault ends
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
