"""A stand-in container for the local SageMaker tests: `fake_container.py train|serve`.

train: writes model/hosts/<current_host>.json (its channels' files, the hyperparameters, the
checkpoint it resumed from, current_host and hosts from resourceconfig.json) and, on the first host
only (a leader, as the trainer's rank 0), model/files.json (the same minus the hosts) and
model/sub/weights.bin and output/tensorboard/run/events.out.fake; then the next checkpoint (atomically). Hyperparameters steer it: `sleep`
(seconds to linger after writing), `sleep-unless-resumed` (the same, only when no checkpoint was
restored), `fail` (text for output/failure, exit 1), `exit-code` (exit with it, no failure file).

serve: a stdlib HTTP server on SAGEMAKER_BIND_HOST:SAGEMAKER_BIND_TO_PORT. GET /ping answers 200;
POST /invocations with JSON {"prompt"} answers {"prompt", "model": model/reply.txt}. The model's
Environment steers it: FAKE_SERVE=crash exits at once, FAKE_SERVE=unhealthy never passes /ping,
FAKE_READY_DELAY (seconds) delays the first 200 from /ping, FAKE_INVOKE_STATUS (an HTTP status)
answers every valid /invocations with that status and the body "injected failure".

Both write their pid to <ATELIER_OPT_ML>/<mode>.pid so tests can check nothing outlives the stack,
and the AWS_* variables they were given to <ATELIER_OPT_ML>/<mode>.aws.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(os.environ.get("ATELIER_OPT_ML", "/opt/ml"))


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def channel_files(channel_dir: Path) -> list[str]:
    return sorted(p.relative_to(channel_dir).as_posix() for p in channel_dir.rglob("*") if p.is_file())


def train() -> int:
    hyperparameters = json.loads((ROOT / "input/config/hyperparameters.json").read_text())
    channels = json.loads((ROOT / "input/config/inputdataconfig.json").read_text())
    resources = json.loads((ROOT / "input/config/resourceconfig.json").read_text())
    checkpoints = ROOT / "checkpoints"
    latest = checkpoints / "latest"
    resumed_from = latest.read_text() if latest.exists() else None
    seen = {"channels": {name: channel_files(ROOT / "input/data" / name) for name in channels},
            "hyperparameters": hyperparameters, "resumed_from": resumed_from}
    model = ROOT / "model"
    (model / "hosts").mkdir(parents=True, exist_ok=True)
    (model / "hosts" / f"{resources['current_host']}.json").write_text(json.dumps(
        {**seen, "current_host": resources["current_host"], "hosts": resources["hosts"]}))
    if resources["current_host"] == resources["hosts"][0]:
        (model / "files.json").write_text(json.dumps(seen))
        (model / "sub").mkdir(exist_ok=True)
        (model / "sub" / "weights.bin").write_bytes(b"\0" * 16)
        (ROOT / "output" / "tensorboard" / "run").mkdir(parents=True, exist_ok=True)  # the trainer's LocalPath
        (ROOT / "output" / "tensorboard" / "run" / "events.out.fake").write_text(f"events of {resources['current_host']}")
    step = int(resumed_from or 0) + 1
    write_atomically(checkpoints / f"step-{step}.txt", f"weights at step {step}")
    write_atomically(latest, str(step))  # the marker last, as the trainer does
    print(f"trained step {step}", flush=True)
    time.sleep(float(hyperparameters.get("sleep", 0)))
    if resumed_from is None:
        time.sleep(float(hyperparameters.get("sleep-unless-resumed", 0)))
    if "fail" in hyperparameters:
        (ROOT / "output" / "failure").write_text(hyperparameters["fail"])
        print("training failed", file=sys.stderr)
        return 1
    return int(hyperparameters.get("exit-code", 0))


def serve() -> int:
    mode = os.environ.get("FAKE_SERVE", "ok")
    if mode == "crash":
        print("cannot load the model", file=sys.stderr)
        return 3
    reply = (ROOT / "model" / "reply.txt").read_text()
    ready_at = time.monotonic() + float(os.environ.get("FAKE_READY_DELAY", "0"))
    invoke_status = int(os.environ.get("FAKE_INVOKE_STATUS", "200"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            healthy = self.path == "/ping" and mode != "unhealthy" and time.monotonic() >= ready_at
            self._send(200 if healthy else 503, b"", "text/plain")

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/invocations" or "prompt" not in request:
                return self._send(400, b"prompt is required", "text/plain")
            if invoke_status != 200:
                return self._send(invoke_status, b"injected failure", "text/plain")
            answer = {"prompt": request["prompt"], "model": reply, "accept": self.headers.get("Accept")}
            self._send(200, json.dumps(answer).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    host = os.environ.get("SAGEMAKER_BIND_HOST", "0.0.0.0")
    ThreadingHTTPServer((host, int(os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080"))), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    mode = sys.argv[1]
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / f"{mode}.pid").write_text(str(os.getpid()))
    (ROOT / f"{mode}.aws.json").write_text(json.dumps({k: v for k, v in os.environ.items() if k.startswith("AWS_")}))
    sys.exit(train() if mode == "train" else serve())
