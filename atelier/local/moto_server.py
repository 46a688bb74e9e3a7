"""moto in server mode, as `python -m moto.server` runs it, with DynamoDB requests taken one at a time and
the patches of atelier/local/moto_shim.py installed.

moto's threaded server handles requests concurrently, and its DynamoDB backend is not safe for
that: concurrent TransactWriteItems calls fail with a 500 ("dictionary changed size during
iteration"), which real DynamoDB never does, so under load the pack stage's batches failed
until they reached the DLQ. Serialising DynamoDB alone keeps S3 and SQS (long polls) concurrent.

werkzeug logs every request; at a few hundred requests a second that is the server's own log I/O
for lines nobody reads. Only requests answered with an error (4xx, 5xx) are logged here.

    python -m atelier.local.moto_server HOST PORT
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable, Iterable

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import run_simple

from atelier.local import moto_shim

DYNAMODB_TARGET = "DynamoDB_"  # X-Amz-Target of every DynamoDB API call


class SerialDynamoDB:
    """WSGI middleware: one DynamoDB request at a time, every other request as it comes."""

    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not environ.get("HTTP_X_AMZ_TARGET", "").startswith(DYNAMODB_TARGET):
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the body is built inside the lock


class ErrorRequestsOnly(logging.Filter):
    """Pass werkzeug's request lines for 4xx and 5xx answers; its other messages pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 3 and str(args[1]).isdigit():  # log_request: (request line, status, size)
            return int(str(args[1])) >= 400
        return True


def main(host: str, port: int) -> None:
    os.environ.setdefault("MOTO_PORT", str(port))  # moto builds queue URLs and the like with it
    moto_shim.apply()  # the IAM rules act only under IAM enforcement (atelier/local/enforcement.py)
    logging.getLogger("werkzeug").addFilter(ErrorRequestsOnly())
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, SerialDynamoDB(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
