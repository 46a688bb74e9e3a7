"""The SageMaker inference contract for a trained pipeline, on the standard library's HTTP server.

    GET  /ping         503 {"error": "loading the model"} while the pipeline loads, then 200
    POST /invocations  JSON (Content-Type application/json) -> image/png, or application/json:
                       {"images": [base64 PNG, ...], "model_id", "manifest", "attribution", "seeds"}

The server listens as soon as the process starts and loads the pipeline meanwhile, so SageMaker's
health check sees 503 (not a refused connection) until the model can answer; a pipeline that fails
to load ends the process with status 1 and the reason in the log.

Request fields: "prompt" (required, non-empty), "negative_prompt", "num_inference_steps" (20),
"guidance_scale" (5.0), "seed" (0; image i uses seed + i), "height"/"width" (multiples of 8,
default the model's size), "num_images" (1). Anything else, a wrong type or a value out of bounds
is a 400 {"error": "<why>"}; a body over the size bound a 413; a Content-Type other than JSON a
415; an Accept that cannot be met (several images as one PNG) a 406; a failure while generating a
500. The response is a PNG for one image unless Accept asks for application/json, and JSON for
several. Every PNG carries text chunks: atelier:model-id, atelier:manifest, atelier:attribution
(from $ATELIER_MODEL_ID, $ATELIER_MANIFEST_DIGEST, $ATELIER_ATTRIBUTION_URI, which DeployFunction
sets in the model's container environment; the manifest falls back to `manifest_digest` in the
model's atelier-training.json, then each to "unknown"), atelier:prompt, atelier:negative-prompt,
atelier:seed, atelier:steps, atelier:guidance. With a signing identity ($ATELIER_C2PA_SECRET, a
Secrets Manager secret the deploy stage names, or the files $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY)
every PNG also carries a signed C2PA manifest with the model id, manifest and attribution
(trainer/credentials.py); an identity that cannot be read or cannot sign fails at start.

Bounds (ServeSettings, from the environment once at start): $SERVE_MAX_STEPS (200),
$SERVE_MAX_SIDE (2048), $SERVE_MAX_IMAGES (4), $SERVE_MAX_BODY_BYTES (65536),
$SERVE_MAX_PROMPT_CHARS (1000), $SERVE_MAX_GUIDANCE (50). The port is $SAGEMAKER_BIND_TO_PORT
(default 8080); the address $SAGEMAKER_BIND_HOST (default 0.0.0.0, what a SageMaker endpoint needs;
the local stack binds 127.0.0.1). One generation runs at a time; the same request gives the same
images.

Speed levers (ServeSettings too; trainer/serve_levers.py says what each does, bench/serve_gpu.py
measures them): $SERVE_COMPILE (default; off|default|max-autotune) and $SERVE_CUDA_GRAPHS (1),
which on a GPU compile the UNet and VAE decoder and replay them as CUDA graphs, for the request
sizes in $SERVE_WARMUP_IMAGES (1; e.g. "1,2,4") before /ping answers 200 (other sizes run eagerly);
off by default: $SERVE_SCHEDULER (default|dpmpp), $SERVE_FUSE_QKV, $SERVE_CHANNELS_LAST,
$SERVE_BATCH_WINDOW_MS (0) and $SERVE_MAX_BATCH (8). With a batch window, requests that arrive
together run as one pipeline call; each still gets its own seeds' images, equal to what it gets
alone up to the last bits of bf16 arithmetic at another batch size.

$SERVE_CPU_THREADS caps torch's CPU threads (unset: every core), as the jobs' `cpu-threads`
hyperparameter does. Any other $SERVE_* name fails at start: a misspelt setting is not ignored.
The deploy stage sets these from the template's ServeEnvironment (contracts/serve_environment.py).
"""

import base64
import io
import json
import math
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from contracts import png_text, serve_environment
from trainer.credentials import Credentials, sign_png
from trainer.serve_levers import COMPILE_MODES, SCHEDULERS, Batcher, apply_levers, compiled, lever_plan

PNG, JSON = "image/png", "application/json"
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range; image i's seed wraps around inside it
SIDE_MULTIPLE = 8  # the VAE's downsampling
UNKNOWN = "unknown"


class BadRequest(ValueError):
    """The request cannot be served as sent; `status` and the message tell the caller why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class ServeSettings:
    """The request bounds (each bounds the time or memory one request can take) and the speed levers."""

    max_steps: int = 200
    max_side: int = 2048
    max_images: int = 4
    max_body_bytes: int = 65536
    max_prompt_chars: int = 1000
    max_guidance: float = 50.0
    scheduler: str = "default"  # the saved pipeline's own
    fuse_qkv: bool = False
    channels_last: bool = False
    compile: str = "default"  # on a GPU only (trainer/serve_levers.py); bench/RESULTS.md has what each lever gave
    cuda_graphs: bool = True
    warmup_images: tuple[int, ...] = (1,)
    batch_window_ms: float = 0.0
    max_batch: int = 8
    cpu_threads: int | None = None  # torch's intra-op threads; None: torch's default (every core)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ServeSettings":
        """$SERVE_<FIELD> overrides each default; a value that does not parse, or a $SERVE_* name that is
        no field, fails at start."""
        names = {f"SERVE_{field.name.upper()}" for field in fields(cls)}
        strangers = sorted(name for name in environ if name.startswith(serve_environment.PREFIX) and name not in names)
        if strangers:
            raise ValueError(f"unknown server settings {strangers}; known: {', '.join(sorted(names))}")
        values = {}
        for field in fields(cls):
            name = f"SERVE_{field.name.upper()}"
            if name in environ:
                values[field.name] = _setting(field, name, environ[name].strip())
        return cls(**values)


CHOICES = {"scheduler": SCHEDULERS, "compile": COMPILE_MODES}
FLAGS = {"1": True, "true": True, "0": False, "false": False}


def _setting(field, name: str, text: str):
    if field.name in CHOICES:
        if text not in CHOICES[field.name]:
            raise ValueError(f"${name} must be one of {', '.join(CHOICES[field.name])}, got {text!r}")
        return text
    if field.type is bool:
        if text.lower() not in FLAGS:
            raise ValueError(f"${name} must be 1 or 0, got {text!r}")
        return FLAGS[text.lower()]
    if field.name == "warmup_images":
        return tuple(_positive(name, part, int) for part in text.split(","))
    return _positive(name, text, float if field.type is float else int, zero=field.name == "batch_window_ms")


def _positive(name: str, text: str, kind: type, zero: bool = False) -> int | float:
    """A positive number (or zero, where `zero`), else ValueError naming the variable."""
    wanted = f"${name} must be a {'non-negative' if zero else 'positive'} {kind.__name__}, got {text!r}"
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(wanted) from None
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(wanted)
    return value


@dataclass(frozen=True)
class Provenance:
    """What every image says about the model that made it."""

    model_id: str
    manifest: str
    attribution: str

    @classmethod
    def from_env(cls, model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> "Provenance":
        """The container environment's values; the manifest from atelier-training.json when it is unset."""
        return cls(
            model_id=environ.get("ATELIER_MODEL_ID") or UNKNOWN,
            manifest=environ.get("ATELIER_MANIFEST_DIGEST") or _recorded_manifest(Path(model_dir)) or UNKNOWN,
            attribution=environ.get("ATELIER_ATTRIBUTION_URI") or UNKNOWN,
        )


def _recorded_manifest(model_dir: Path) -> str | None:
    try:
        record = json.loads((model_dir / "atelier-training.json").read_text())
    except (OSError, ValueError):
        return None
    digest = record.get("manifest_digest") if isinstance(record, dict) else None
    return digest if isinstance(digest, str) and digest else None


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Generation:
    """One validated request."""

    prompt: str
    negative_prompt: str | None = None
    num_inference_steps: int = 20
    guidance_scale: float = 5.0
    seed: int = 0
    height: int | None = None
    width: int | None = None
    num_images: int = 1

    @property
    def seeds(self) -> list[int]:
        return [(self.seed + i) % (MAX_SEED + 1) for i in range(self.num_images)]


FIELDS = {field.name for field in fields(Generation)}


def parse_request(body: bytes, settings: ServeSettings) -> Generation:
    """The request body -> a Generation, defaults filled in; BadRequest saying what is wrong."""
    try:
        request = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise BadRequest(f"the body must be a JSON object: {error}") from None
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(request) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}")
    request = {name: value for name, value in request.items() if value is not None}  # null means the default
    prompt = request.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest('"prompt" (a non-empty string) is required')
    _check_text(request, "prompt", settings.max_prompt_chars)
    _check_text(request, "negative_prompt", settings.max_prompt_chars)
    _check_int(request, "num_inference_steps", 1, settings.max_steps)
    _check_int(request, "seed", 0, MAX_SEED)
    _check_int(request, "num_images", 1, settings.max_images)
    for side in ("height", "width"):
        _check_int(request, side, SIDE_MULTIPLE, settings.max_side)
        if side in request and request[side] % SIDE_MULTIPLE:
            raise BadRequest(f'"{side}" must be a multiple of {SIDE_MULTIPLE}')
    guidance = request.get("guidance_scale", 0.0)
    if isinstance(guidance, bool) or not isinstance(guidance, int | float) or not 0 <= guidance <= settings.max_guidance:
        raise BadRequest(f'"guidance_scale" must be a number from 0 to {settings.max_guidance:g}')
    if "guidance_scale" in request:
        request["guidance_scale"] = float(guidance)
    return Generation(**request)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(request: dict, name: str, max_chars: int) -> None:
    if name not in request:
        return
    if not isinstance(request[name], str):
        raise BadRequest(f'"{name}" must be a string')
    if len(request[name]) > max_chars:
        raise BadRequest(f'"{name}" must be at most {max_chars} characters (got {len(request[name])})')


def _check_int(request: dict, name: str, low: int, high: int) -> None:
    value = request.get(name, low)
    # JSON true/false arrive as bool, which Python counts as int
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f'"{name}" must be an integer from {low} to {high}')


def check_content_type(content_type: str | None) -> None:
    """JSON, or no type at all (InvokeEndpoint without ContentType sends application/octet-stream)."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type not in ("", JSON, "application/octet-stream"):
        raise BadRequest(f"Content-Type must be {JSON}, got {content_type!r}", 415)


def body_length(content_length: str | None, settings: ServeSettings) -> int:
    """The body's declared size, within the bound; the body itself is not read before this passes."""
    if content_length is None:
        raise BadRequest("a Content-Length header is required", 411)
    try:
        length = int(content_length)
    except ValueError:
        raise BadRequest(f"Content-Length must be a number of bytes, got {content_length!r}") from None
    if length < 0:
        raise BadRequest(f"Content-Length must be a number of bytes, got {content_length!r}")
    if length > settings.max_body_bytes:
        raise BadRequest(f"the body is {length} bytes; at most {settings.max_body_bytes} (Content-Length) are accepted", 413)
    return length


def response_type(accept: str | None, num_images: int) -> str:
    """image/png or application/json, from the Accept header's first media range we can meet."""
    ranges = [part.split(";")[0].strip().lower() for part in (accept or "*/*").split(",")]
    for media_range in ranges:
        if media_range == JSON:
            return JSON
        if media_range in (PNG, "image/*", "*/*", ""):
            if num_images == 1:
                return PNG
            if media_range in ("*/*", ""):
                return JSON
    if PNG in ranges or "image/*" in ranges:
        raise BadRequest(f"{num_images} images cannot be one image/png; send Accept: {JSON} for several", 406)
    raise BadRequest(f"Accept must allow {PNG} or {JSON}, got {accept!r}", 406)


# ---------------------------------------------------------------- generation


WARMUP_STEPS = 3  # CUDA graph trees warm up, record, then replay: the third UNet call replays


def load_pipeline(model_dir: str | Path, settings: ServeSettings = ServeSettings()) -> DiffusionPipeline:
    """The saved pipeline on the GPU in bf16 when there is one, else on the CPU in fp32, with the
    settings' speed levers applied and, when it compiles, the warm-up shapes compiled."""
    if not (Path(model_dir) / "model_index.json").is_file():  # never a hub id: diffusers would try to download it
        raise FileNotFoundError(f"no diffusers pipeline (model_index.json) in {model_dir}")
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir))
    pipeline.set_progress_bar_config(disable=True)
    if torch.cuda.is_available():
        pipeline = pipeline.to("cuda", torch.bfloat16)
    plan = lever_plan(settings, torch.cuda.is_available())
    apply_levers(pipeline, plan)
    if compiled(plan):
        warm_up(pipeline, settings.warmup_images)
    return pipeline


def warm_up(pipeline: DiffusionPipeline, images_per_request: tuple[int, ...]) -> None:
    """Compile (and record the CUDA graphs of) each request size at the model's size and default guidance."""
    for images in images_per_request:
        for _ in range(2):  # the VAE decoder runs once a call: its graph records on the second
            _run(pipeline, Generation("warm-up", num_inference_steps=WARMUP_STEPS, num_images=images))


def generate(pipeline: DiffusionPipeline, generation: Generation) -> list[Image.Image]:
    """The request's images; image i draws its starting noise from seed + i. A shape the warm-up did
    not compile runs eagerly instead of compiling for minutes inside a request."""
    with torch.compiler.set_stance("eager_on_recompile"):
        return _run(pipeline, generation)


def _run(pipeline: DiffusionPipeline, generation: Generation) -> list[Image.Image]:
    return pipeline(
        generation.prompt,
        negative_prompt=generation.negative_prompt,
        num_inference_steps=generation.num_inference_steps,
        guidance_scale=generation.guidance_scale,
        height=generation.height,
        width=generation.width,
        num_images_per_prompt=generation.num_images,
        # CPU generators draw the same starting noise whatever device runs the model.
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in generation.seeds],
    ).images


def batch_key(generation: Generation) -> tuple:
    """What requests sharing one pipeline call must agree on (prompts and seeds may differ)."""
    return (generation.num_inference_steps, generation.guidance_scale, generation.height, generation.width,
            generation.negative_prompt is None)


def generate_batch(pipeline: DiffusionPipeline, generations: list[Generation]) -> list[list[Image.Image]]:
    """Several requests of one batch_key as one pipeline call: each request's images, from its own seeds."""
    first = generations[0]
    prompts = [g.prompt for g in generations for _ in range(g.num_images)]
    negatives = None if first.negative_prompt is None else [g.negative_prompt for g in generations for _ in range(g.num_images)]
    with torch.compiler.set_stance("eager_on_recompile"):
        images = pipeline(
            prompts, negative_prompt=negatives, num_inference_steps=first.num_inference_steps,
            guidance_scale=first.guidance_scale, height=first.height, width=first.width,
            generator=[torch.Generator("cpu").manual_seed(seed) for g in generations for seed in g.seeds],
        ).images
    split, start = [], 0
    for generation in generations:
        split.append(images[start:start + generation.num_images])
        start += generation.num_images
    return split


def png_bytes(image: Image.Image, generation: Generation, seed: int, provenance: Provenance,
              credentials: Credentials | None = None) -> bytes:
    """The image as PNG with its provenance and settings in text chunks (iTXt when not Latin-1),
    and a signed C2PA manifest when there are credentials."""
    info = PngInfo()
    for key, value in (
        (png_text.MODEL_ID, provenance.model_id),
        (png_text.MANIFEST, provenance.manifest),
        (png_text.ATTRIBUTION, provenance.attribution),
        (png_text.PROMPT, generation.prompt),
        (png_text.NEGATIVE_PROMPT, generation.negative_prompt or ""),
        (png_text.SEED, str(seed)),
        (png_text.STEPS, str(generation.num_inference_steps)),
        (png_text.GUIDANCE, f"{generation.guidance_scale:g}"),
    ):
        info.add_text(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    if credentials is None:
        return buffer.getvalue()
    return sign_png(buffer.getvalue(), asdict(provenance), credentials)


def json_body(pngs: list[bytes], seeds: list[int], provenance: Provenance) -> bytes:
    return json.dumps({
        "images": [base64.b64encode(png).decode("ascii") for png in pngs],
        "model_id": provenance.model_id,
        "manifest": provenance.manifest,
        "attribution": provenance.attribution,
        "seeds": seeds,
    }).encode()


# ---------------------------------------------------------------- HTTP


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
