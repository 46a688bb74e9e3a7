"""The SageMaker inference contract for a trained pipeline, on the standard library's HTTP server.

    GET  /ping         200 once the pipeline is loaded (the server listens only after loading)
    POST /invocations  JSON {"prompt": str, "num_inference_steps"?: int = 20, "seed"?: int = 0,
                             "guidance_scale"?: float = 5.0, "height"?: int, "width"?: int}
                       -> 200 image/png; 400 {"error": ...} for a bad request

Height and width default to the size the model was trained for. The port is
$SAGEMAKER_BIND_TO_PORT (default 8080); the address $SAGEMAKER_BIND_HOST (default 0.0.0.0, what a
SageMaker endpoint needs; the local stack binds 127.0.0.1).
"""

import io
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

DEFAULTS = {"num_inference_steps": 20, "seed": 0, "guidance_scale": 5.0, "height": None, "width": None}
MAX_STEPS = 200  # bounds the time one request can hold the model
MAX_SIDE = 2048


class BadRequest(ValueError):
    """The request cannot be served as sent; the message tells the caller why."""


def load_pipeline(model_dir: str | Path) -> DiffusionPipeline:
    """The saved pipeline on the GPU in bf16 when there is one, else on the CPU in fp32."""
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    pipeline.set_progress_bar_config(disable=True)
    if torch.cuda.is_available():
        return pipeline.to("cuda", torch.bfloat16)
    return pipeline


def parse_request(body: bytes) -> dict:
    """The request body -> the generation settings, defaults filled in; BadRequest if malformed."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body must be a JSON object: {error}") from None
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(request) - set(DEFAULTS) - {"prompt"})
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}")
    prompt = request.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest('"prompt" (a non-empty string) is required')
    settings = {**DEFAULTS, **request}
    _check_int(settings, "num_inference_steps", 1, MAX_STEPS)
    _check_int(settings, "seed", 0, 2**63 - 1)
    for side in ("height", "width"):
        if settings[side] is not None:
            _check_int(settings, side, 8, MAX_SIDE)
            if settings[side] % 8:
                raise BadRequest(f'"{side}" must be a multiple of 8')
    guidance = settings["guidance_scale"]
    if isinstance(guidance, bool) or not isinstance(guidance, int | float):
        raise BadRequest('"guidance_scale" must be a number')
    return settings


def _check_int(settings: dict, name: str, low: int, high: int) -> None:
    value = settings[name]
    # JSON true/false arrive as bool, which Python counts as int
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f'"{name}" must be an integer from {low} to {high}')


def generate_png(pipeline: DiffusionPipeline, settings: dict) -> bytes:
    """One image for the settings, as PNG bytes; the same seed gives the same image."""
    image = pipeline(
        settings["prompt"],
        num_inference_steps=settings["num_inference_steps"],
        guidance_scale=float(settings["guidance_scale"]),
        height=settings["height"],
        width=settings["width"],
        # A CPU generator draws the same starting noise whatever device runs the model.
        generator=torch.Generator("cpu").manual_seed(settings["seed"]),
    ).images[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class InferenceHandler(BaseHTTPRequestHandler):
    server: "InferenceServer"

    def do_GET(self) -> None:
        if self.path == "/ping":
            self.respond(200, b"", "text/plain")
        else:
            self.respond_error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:
        if self.path != "/invocations":
            self.respond_error(404, f"no route POST {self.path}")
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            settings = parse_request(body)
        except BadRequest as error:
            self.respond_error(400, str(error))
            return
        try:
            with self.server.lock:  # one generation at a time: the pipeline is not thread-safe
                png = generate_png(self.server.pipeline, settings)
        except Exception as error:  # the endpoint reports the failure and keeps serving
            self.respond_error(500, f"{type(error).__name__}: {error}")
            return
        self.respond(200, png, "image/png")

    def respond(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def respond_error(self, status: int, message: str) -> None:
        self.respond(status, json.dumps({"error": message}).encode(), "application/json")


class InferenceServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, pipeline: DiffusionPipeline, host: str, port: int):
        super().__init__((host, port), InferenceHandler)
        self.pipeline = pipeline
        self.lock = threading.Lock()


def main(model_dir: str | Path) -> None:
    """Load the pipeline, then answer /ping and /invocations until stopped."""
    pipeline = load_pipeline(model_dir)
    host = os.environ.get("SAGEMAKER_BIND_HOST", "0.0.0.0")
    port = int(os.environ.get("SAGEMAKER_BIND_TO_PORT", 8080))
    with InferenceServer(pipeline, host, port) as server:
        print(json.dumps({"event": "serving", "model_dir": str(model_dir), "host": host, "port": port}), flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/opt/ml/model")
