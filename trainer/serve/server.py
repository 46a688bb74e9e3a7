"""The SageMaker inference contract for a trained pipeline, on the standard library's HTTP server.

    GET  /ping         503 {"error": "loading the model"} while the pipeline loads, then 200
    POST /invocations  JSON (Content-Type application/json) -> image/png, or application/json:
                       {"images": [base64 PNG, ...], "model_id", "manifest", "attribution", "seeds"}

The server listens as soon as the process starts and loads the pipeline meanwhile, so SageMaker's
health check sees 503 (not a refused connection) until the model can answer; a pipeline that fails
to load ends the process with status 1 and the reason in the log.

By hand: `python -m trainer.serve.server <model dir>` (the image runs `python -m trainer.container serve`).
The port is $SAGEMAKER_BIND_TO_PORT (default 8080); the address $SAGEMAKER_BIND_HOST (default
0.0.0.0, what a SageMaker endpoint needs; the local stack binds 127.0.0.1). One generation runs at
a time; the same request gives the same images.

What a request may ask and what it gets back: trainer/serve/protocol.py; the settings ($SERVE_*) and
the provenance every image carries: trainer/serve/settings.py; the pipeline loaded, warmed up and
run: trainer/serve/generation.py.
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from PIL import Image

from trainer.serve.credentials import Credentials
from trainer.serve.generation import batch_key, check_request, generate, generate_batch, load_pipeline
from trainer.serve.levers import Batcher, lever_plan
from trainer.serve.protocol import (JSON, PNG, BadRequest, Generation, body_length, check_content_type, json_body,
                                    parse_request, png_bytes, response_type)
from trainer.serve.settings import Provenance, ServeSettings


class InferenceHandler(BaseHTTPRequestHandler):
    server: "InferenceServer"

    def do_GET(self) -> None:
        if self.path != "/ping":
            self.respond_error(404, f"no route GET {self.path}")
        elif self.server.pipeline is None:
            self.respond_error(503, "loading the model")
        else:
            self.respond(200, b"", "text/plain")

    def do_POST(self) -> None:
        if self.path != "/invocations":
            self.close_connection = True  # the body is left unread
            self.respond_error(404, f"no route POST {self.path}")
            return
        try:
            generation, content_type = self.read_request()
        except BadRequest as error:
            self.respond_error(error.status, str(error))
            return
        if self.server.pipeline is None:
            self.respond_error(503, "loading the model")
            return
        try:
            check_request(self.server.pipeline, generation)
        except BadRequest as error:
            self.respond_error(error.status, str(error))
            return
        provenance, credentials = self.server.provenance, self.server.credentials
        try:
            images = self.server.generations.submit(generation)
            pngs = [png_bytes(image, generation, seed, provenance, credentials)
                    for image, seed in zip(images, generation.seeds)]
        except Exception as error:  # the endpoint reports the failure (C2PA signing's too) and keeps serving
            self.respond_error(500, f"{type(error).__name__}: {error}")
            return
        if content_type == PNG:
            self.respond(200, pngs[0], PNG)
        else:
            self.respond(200, json_body(pngs, generation.seeds, provenance), JSON)

    def read_request(self) -> tuple[Generation, str]:
        """The validated request and the response type, or BadRequest; an oversized body is never read."""
        settings = self.server.settings
        try:
            check_content_type(self.headers.get("Content-Type"))
            length = body_length(self.headers.get("Content-Length"), settings)
        except BadRequest:
            self.close_connection = True  # the body is left unread
            raise
        generation = parse_request(self.rfile.read(length), settings)
        return generation, response_type(self.headers.get("Accept"), generation.num_images)

    def respond(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def respond_error(self, status: int, message: str) -> None:
        self.respond(status, json.dumps({"error": message}).encode(), JSON)


class InferenceServer(ThreadingHTTPServer):
    """Listens at once; answers 503 until `pipeline` is set; signs images when given credentials.
    Generations run on one thread (`generations`): its own, or with `generation_thread=False` the
    caller's, which then runs `generations.serve()`."""

    daemon_threads = True

    def __init__(self, host: str, port: int, settings: ServeSettings, provenance: Provenance,
                 pipeline: DiffusionPipeline | None = None, credentials: Credentials | None = None,
                 generation_thread: bool = True):
        super().__init__((host, port), InferenceHandler)
        self.settings, self.provenance, self.credentials = settings, provenance, credentials
        self.pipeline = pipeline
        self.generations = Batcher(self.run, batch_key, settings.batch_window_ms / 1000, settings.max_batch,
                                   start=generation_thread)

    def run(self, generations: list[Generation]) -> list[list[Image.Image]]:
        """One call of the pipeline (not thread-safe: only the generation thread calls it)."""
        if len(generations) == 1:  # alone, a request gets exactly the images it gets without a window
            return [generate(self.pipeline, generations[0])]
        return generate_batch(self.pipeline, generations)

    def server_close(self) -> None:
        self.generations.close()
        super().server_close()


def main(model_dir: str | Path) -> None:
    """Listen, load the pipeline, then answer /ping and /invocations until stopped."""
    settings, provenance = ServeSettings.from_env(), Provenance.from_env(model_dir)
    credentials = Credentials.from_env()
    if settings.cpu_threads is not None:
        torch.set_num_threads(settings.cpu_threads)
    host = os.environ.get("SAGEMAKER_BIND_HOST", "0.0.0.0")
    port = int(os.environ.get("SAGEMAKER_BIND_TO_PORT", 8080))
    # this thread loads, warms up and then runs every generation (the CUDA graphs it records are its own)
    with InferenceServer(host, port, settings, provenance, credentials=credentials, generation_thread=False) as server:
        thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
        thread.start()
        print(json.dumps({"event": "loading", "model_dir": str(model_dir), "host": host, "port": port}), flush=True)
        try:
            server.pipeline = load_pipeline(model_dir, settings)
        except BaseException:
            server.shutdown()
            raise
        print(json.dumps({"event": "serving", "model_dir": str(model_dir), "host": host, "port": port,
                          "model_id": provenance.model_id, "manifest": provenance.manifest,
                          "c2pa": credentials is not None, "cpu_threads": torch.get_num_threads(),
                          "levers": lever_plan(settings, torch.cuda.is_available())}), flush=True)
        server.generations.serve()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/opt/ml/model")
