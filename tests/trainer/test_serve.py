"""trainer.serve: the endpoint contract (/ping, /invocations -> PNG) over real HTTP."""

import http.client
import io
import json
import threading

import pytest
from PIL import Image

from trainer.serve import BadRequest, InferenceServer, load_pipeline, parse_request


@pytest.fixture(scope="module")
def server(trained):
    """The trained tiny pipeline behind a server on a free local port."""
    with InferenceServer(load_pipeline(trained["model_dir"]), "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server
        server.shutdown()


def request(server, method: str, path: str, body: bytes = b"") -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.getheader("Content-Type"), response.read()


def invoke(server, payload) -> tuple[int, str, bytes]:
    return request(server, "POST", "/invocations", json.dumps(payload).encode())


def test_ping_answers_200_once_loaded(server):
    assert request(server, "GET", "/ping")[0] == 200


def test_invocations_return_a_png_of_the_model_size(server):
    status, content_type, body = invoke(server, {"prompt": "a red dog", "num_inference_steps": 2})
    assert (status, content_type) == (200, "image/png")
    assert body[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(body), formats=["PNG"])
    assert (image.size, image.mode) == ((64, 64), "RGB")


def test_height_and_width_set_the_image_size(server):
    status, _, body = invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "height": 32, "width": 48})
    assert status == 200
    assert Image.open(io.BytesIO(body)).size == (48, 32)


def test_the_same_seed_gives_the_same_image_and_another_seed_another(server):
    def png(seed):
        return invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "seed": seed})[2]

    assert png(3) == png(3)
    assert png(3) != png(4)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body must be a JSON object: "),
        (b"[1, 2]", "the body must be a JSON object"),
        (b"{}", '"prompt" (a non-empty string) is required'),
        (b'{"prompt": 5}', '"prompt" (a non-empty string) is required'),
        (b'{"prompt": "a", "num_inference_steps": "20"}', '"num_inference_steps" must be an integer from 1 to 200'),
        (b'{"prompt": "a", "seed": true}', '"seed" must be an integer from 0 to'),
        (b'{"prompt": "a", "height": 60}', '"height" must be a multiple of 8'),
        (b'{"prompt": "a", "guidance_scale": "high"}', '"guidance_scale" must be a number'),
        (b'{"prompt": "a", "steps": 3}', "unknown fields: steps"),
    ],
)
def test_a_bad_request_is_a_400_that_says_why(server, body, message):
    status, content_type, response = request(server, "POST", "/invocations", body)
    assert (status, content_type) == (400, "application/json")
    assert json.loads(response)["error"].startswith(message)


def test_unknown_routes_are_404(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/ping")[0] == 404


def test_defaults_fill_what_the_request_leaves_out():
    assert parse_request(b'{"prompt": "a cat"}') == {
        "prompt": "a cat", "num_inference_steps": 20, "seed": 0, "guidance_scale": 5.0, "height": None, "width": None,
    }
    with pytest.raises(BadRequest):
        parse_request(b'{"prompt": "   "}')
