"""One /invocations request and its response: the fields, their bounds, the headers, the bodies.

Request fields: "prompt" (required, non-empty), "negative_prompt", "num_inference_steps" (20),
"guidance_scale" (5.0; a Flux without guidance embeddings takes it as its true-CFG scale: always where its training
record says it learned an unconditional prediction, else with a negative prompt), "seed" (0; image i uses seed + i), "height"/"width"
(multiples of 8, default the model's size; for a transformer also of its VAE's downsampling times its patch, Flux's
2x2 packing included, and for SD3 within its position table: trainer/serve/generation.py `check_request`, which
also refuses a negative prompt for a guidance-distilled Flux), "num_images" (1). Anything else, a wrong type or a value out of bounds
is a 400 {"error": "<why>"}; a body over the size bound a 413; a Content-Type other than JSON a
415; an Accept that cannot be met (several images as one PNG) a 406; a failure while generating a
500. The response is a PNG for one image unless Accept asks for application/json, and JSON for
several. Every PNG carries text chunks: atelier:model-id, atelier:manifest, atelier:attribution
(the Provenance of trainer/serve/settings.py), atelier:prompt, atelier:negative-prompt,
atelier:seed, atelier:steps, atelier:guidance. With $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY set,
every PNG also carries a signed C2PA manifest with the model id, manifest and attribution
(trainer/serve/credentials.py); credentials that cannot sign fail at start.
"""

import base64
import io
import json
from dataclasses import asdict, dataclass, fields

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from contracts import png_text
from trainer.serve.credentials import Credentials, sign_png
from trainer.serve.settings import Provenance, ServeSettings

PNG, JSON = "image/png", "application/json"
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range; image i's seed wraps around inside it
SIDE_MULTIPLE = 8  # the VAE's downsampling


class BadRequest(ValueError):
    """The request cannot be served as sent; `status` and the message tell the caller why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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


# ---------------------------------------------------------------- response bodies


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
