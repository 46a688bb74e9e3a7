"""trainer.serve.server: the endpoint contract (/ping, /invocations -> PNG or JSON) over real HTTP."""

import base64
import http.client
import io
import json
import socket
import threading
from dataclasses import fields

import pytest
import torch
from PIL import Image

from contracts import serve_environment
from trainer.serve.generation import load_pipeline
from trainer.serve.protocol import BadRequest, Generation, parse_request
from trainer.serve.server import InferenceServer
from trainer.serve.server import main as serve_main
from trainer.serve.settings import Provenance, ServeSettings

PROVENANCE = Provenance(model_id="atelier-0123456789abcdef0123", manifest="9f2c" * 16,
                        attribution="s3://models/attribution/atelier-0123456789abcdef0123.json")
SETTINGS = ServeSettings(max_steps=10, max_side=256, max_images=3, max_body_bytes=2048, max_prompt_chars=40)


@pytest.fixture(scope="module")
def pipeline(trained):
    return load_pipeline(trained["model_dir"])


def serving(server: InferenceServer):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def server(pipeline):
    """The trained tiny pipeline behind a server on a free local port."""
    with InferenceServer("127.0.0.1", 0, SETTINGS, PROVENANCE, pipeline) as server:
        serving(server)
        yield server
        server.shutdown()


def request(server, method: str, path: str, body: bytes = b"", **headers) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    headers = {"Content-Type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
    connection.request(method, path, body=body, headers={k: v for k, v in headers.items() if v is not None})
    response = connection.getresponse()
    return response.status, response.getheader("Content-Type"), response.read()


def invoke(server, payload, **headers) -> tuple[int, str, bytes]:
    return request(server, "POST", "/invocations", json.dumps(payload).encode(), **headers)


def error_of(response: tuple[int, str, bytes]) -> tuple[int, str, str]:
    status, content_type, body = response
    return status, content_type, json.loads(body)["error"]


# ---------------------------------------------------------------- /ping


def test_ping_is_503_while_loading_and_200_once_loaded(pipeline):
    # GIVEN a server listening before its pipeline is loaded
    with InferenceServer("127.0.0.1", 0, SETTINGS, PROVENANCE) as server:
        serving(server)
        try:
            # THEN /ping and /invocations say it is loading
            assert error_of(request(server, "GET", "/ping")) == (503, "application/json", "loading the model")
            assert error_of(invoke(server, {"prompt": "a dog"}))[:2] == (503, "application/json")
            # WHEN the pipeline is in place THEN /ping is healthy
            server.pipeline = pipeline
            assert request(server, "GET", "/ping")[0] == 200
        finally:
            server.shutdown()


def test_a_pipeline_that_cannot_load_ends_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGEMAKER_BIND_HOST", "127.0.0.1")
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "0")
    with pytest.raises(FileNotFoundError, match="no diffusers pipeline"):
        serve_main(tmp_path / "no-model")


def test_the_cpu_threads_setting_applies_before_the_pipeline_loads(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("SAGEMAKER_BIND_HOST", "127.0.0.1")
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "0")
    monkeypatch.setenv("SERVE_CPU_THREADS", str(before + 1))  # a count torch does not have already
    try:
        with pytest.raises(FileNotFoundError, match="no diffusers pipeline"):
            serve_main(tmp_path / "no-model")
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- images


def test_one_image_is_a_png_of_the_model_size_whatever_accept_allows_it(server):
    for accept in (None, "*/*", "image/png", "image/*, application/json"):
        status, content_type, body = invoke(server, {"prompt": "a red dog", "num_inference_steps": 1}, Accept=accept)
        assert (status, content_type) == (200, "image/png")
        assert body[:8] == b"\x89PNG\r\n\x1a\n"
        image = Image.open(io.BytesIO(body), formats=["PNG"])
        assert (image.size, image.mode) == ((32, 32), "RGB")  # the resolution the model was trained at


def test_every_png_carries_its_provenance_and_settings(server):
    payload = {"prompt": "a red dog", "negative_prompt": "blurry", "num_inference_steps": 2, "seed": 11,
               "guidance_scale": 3.5}
    _, _, body = invoke(server, payload)
    assert Image.open(io.BytesIO(body)).text == {
        "atelier:model-id": PROVENANCE.model_id,
        "atelier:manifest": PROVENANCE.manifest,
        "atelier:attribution": PROVENANCE.attribution,
        "atelier:prompt": "a red dog",
        "atelier:negative-prompt": "blurry",
        "atelier:seed": "11",
        "atelier:steps": "2",
        "atelier:guidance": "3.5",
    }


def test_a_prompt_outside_latin1_travels_in_an_itxt_chunk(server):
    _, _, body = invoke(server, {"prompt": "un chien rouge ✓ 犬", "num_inference_steps": 1})
    assert Image.open(io.BytesIO(body)).text["atelier:prompt"] == "un chien rouge ✓ 犬"


def test_height_and_width_set_the_image_size(server):
    status, _, body = invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "height": 32, "width": 48})
    assert status == 200
    assert Image.open(io.BytesIO(body)).size == (48, 32)


def test_the_same_seed_gives_the_same_image_and_another_seed_another(server):
    def png(seed):
        return invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "seed": seed})[2]

    assert png(3) == png(3)
    assert png(3) != png(4)


def test_several_images_come_back_as_json_with_their_seeds_and_provenance(server):
    status, content_type, body = invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "seed": 7,
                                                 "num_images": 3}, Accept="application/json")
    assert (status, content_type) == (200, "application/json")
    reply = json.loads(body)
    assert {key: reply[key] for key in ("model_id", "manifest", "attribution", "seeds")} == {
        "model_id": PROVENANCE.model_id, "manifest": PROVENANCE.manifest, "attribution": PROVENANCE.attribution,
        "seeds": [7, 8, 9],
    }
    images = [Image.open(io.BytesIO(base64.b64decode(data)), formats=["PNG"]) for data in reply["images"]]
    assert [image.text["atelier:seed"] for image in images] == ["7", "8", "9"]
    assert [image.size for image in images] == [(32, 32)] * 3
    assert len({image.tobytes() for image in images}) == 3


def test_one_image_as_json_when_accept_asks_for_it(server):
    status, content_type, body = invoke(server, {"prompt": "a dog", "num_inference_steps": 1}, Accept="application/json")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body)["seeds"] == [0]


def test_several_images_without_an_accept_header_are_json(server):
    status, content_type, body = invoke(server, {"prompt": "a dog", "num_inference_steps": 1, "num_images": 2},
                                        Accept=None)
    assert (status, content_type, len(json.loads(body)["images"])) == (200, "application/json", 2)


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "the body must be a JSON object: "),
        (b"\xff\xfe", 400, "the body must be a JSON object: "),
        (b"[1, 2]", 400, "the body must be a JSON object"),
        (b"{}", 400, '"prompt" (a non-empty string) is required'),
        (b'{"prompt": 5}', 400, '"prompt" (a non-empty string) is required'),
        (b'{"prompt": "   "}', 400, '"prompt" (a non-empty string) is required'),
        (b'{"prompt": "' + b"a" * 41 + b'"}', 400, '"prompt" must be at most 40 characters (got 41)'),
        (b'{"prompt": "a", "negative_prompt": 3}', 400, '"negative_prompt" must be a string'),
        (b'{"prompt": "a", "num_inference_steps": "20"}', 400, '"num_inference_steps" must be an integer from 1 to 10'),
        (b'{"prompt": "a", "num_inference_steps": 11}', 400, '"num_inference_steps" must be an integer from 1 to 10'),
        (b'{"prompt": "a", "num_inference_steps": 2.0}', 400, '"num_inference_steps" must be an integer from 1 to 10'),
        (b'{"prompt": "a", "seed": true}', 400, '"seed" must be an integer from 0 to'),
        (b'{"prompt": "a", "seed": -1}', 400, '"seed" must be an integer from 0 to'),
        (b'{"prompt": "a", "height": 60}', 400, '"height" must be a multiple of 8'),
        (b'{"prompt": "a", "width": 264}', 400, '"width" must be an integer from 8 to 256'),
        (b'{"prompt": "a", "guidance_scale": "high"}', 400, '"guidance_scale" must be a number from 0 to 50'),
        (b'{"prompt": "a", "guidance_scale": NaN}', 400, "the body must be a JSON object: NaN is not a JSON number"),
        (b'{"prompt": "a", "guidance_scale": 51}', 400, '"guidance_scale" must be a number from 0 to 50'),
        (b'{"prompt": "a", "num_images": 0}', 400, '"num_images" must be an integer from 1 to 3'),
        (b'{"prompt": "a", "num_images": 4}', 400, '"num_images" must be an integer from 1 to 3'),
        (b'{"prompt": "a", "steps": 3}', 400, "unknown fields: steps; known: "),
    ],
)
def test_a_bad_request_is_a_4xx_that_says_why(server, body, status, message):
    reply = error_of(request(server, "POST", "/invocations", body))
    assert reply[:2] == (status, "application/json")
    assert reply[2].startswith(message)


def test_several_images_as_one_png_are_refused_with_406(server):
    reply = error_of(invoke(server, {"prompt": "a", "num_images": 2}, Accept="image/png"))
    assert reply == (406, "application/json",
                     "2 images cannot be one image/png; send Accept: application/json for several")


def test_an_accept_the_server_cannot_meet_is_406(server):
    reply = error_of(invoke(server, {"prompt": "a"}, Accept="text/html"))
    assert reply == (406, "application/json", "Accept must allow image/png or application/json, got 'text/html'")


def test_a_body_over_the_bound_is_413_before_it_is_read(server):
    reply = error_of(request(server, "POST", "/invocations", b'{"prompt": "' + b"a" * 3000 + b'"}'))
    assert reply == (413, "application/json", "the body is 3014 bytes; at most 2048 (Content-Length) are accepted")


def test_a_body_that_is_not_json_by_its_content_type_is_415(server):
    reply = error_of(request(server, "POST", "/invocations", b"prompt=a", Content_Type="text/plain"))
    assert reply == (415, "application/json", "Content-Type must be application/json, got 'text/plain'")


def test_a_post_without_content_length_is_411(server):
    with socket.create_connection(server.server_address, timeout=30) as connection:
        connection.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n")
        reply = connection.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 411 ")
    assert reply.endswith(b'{"error": "a Content-Length header is required"}')


def test_the_server_keeps_serving_after_bad_requests(server):
    request(server, "POST", "/invocations", b"{not json")
    assert invoke(server, {"prompt": "a dog", "num_inference_steps": 1})[0] == 200


def test_unknown_routes_are_404(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/ping")[0] == 404


# ---------------------------------------------------------------- parsing and settings


def test_defaults_fill_what_the_request_leaves_out():
    assert parse_request(b'{"prompt": "a cat", "seed": null}', ServeSettings()) == Generation(
        prompt="a cat", negative_prompt=None, num_inference_steps=20, guidance_scale=5.0, seed=0, height=None,
        width=None, num_images=1)
    with pytest.raises(BadRequest):
        parse_request(b'{"prompt": "   "}', ServeSettings())


def test_settings_come_from_the_environment_once():
    assert ServeSettings.from_env({}) == ServeSettings()
    assert ServeSettings.from_env({"SERVE_MAX_STEPS": "50", "SERVE_MAX_IMAGES": "8", "SERVE_MAX_BODY_BYTES": "100",
                                   "SERVE_MAX_SIDE": "512", "SERVE_MAX_PROMPT_CHARS": "77",
                                   "SERVE_MAX_GUIDANCE": "12.5"}) == ServeSettings(
        max_steps=50, max_side=512, max_images=8, max_body_bytes=100, max_prompt_chars=77, max_guidance=12.5)
    for bad in ("0", "-3", "many", "1.5"):
        with pytest.raises(ValueError, match=r"^\$SERVE_MAX_STEPS must be a positive int, got"):
            ServeSettings.from_env({"SERVE_MAX_STEPS": bad})


def test_an_unknown_server_setting_fails_at_start_not_ignored():
    with pytest.raises(ValueError, match=r"unknown server settings \['SERVE_COMPLE'\]; known: .*SERVE_COMPILE"):
        ServeSettings.from_env({"SERVE_COMPLE": "off"})
    assert ServeSettings.from_env({"SERVE_CPU_THREADS": "1", "OTHER": "x"}) == ServeSettings(cpu_threads=1)
    with pytest.raises(ValueError, match=r"^\$SERVE_CPU_THREADS must be a positive int, got '0'"):
        ServeSettings.from_env({"SERVE_CPU_THREADS": "0"})


def test_the_deploy_stage_checks_the_names_the_server_reads():
    assert serve_environment.VARIABLES == {f"SERVE_{field.name.upper()}" for field in fields(ServeSettings)}


def test_provenance_comes_from_the_container_environment(tmp_path):
    environ = {"ATELIER_MODEL_ID": "m-1", "ATELIER_MANIFEST_DIGEST": "d" * 64, "ATELIER_ATTRIBUTION_URI": "s3://a/b.json"}
    (tmp_path / "atelier-training.json").write_text(json.dumps({"manifest_digest": "recorded"}))
    assert Provenance.from_env(tmp_path, environ) == Provenance("m-1", "d" * 64, "s3://a/b.json")


def test_provenance_falls_back_to_the_training_record_then_unknown(tmp_path):
    assert Provenance.from_env(tmp_path, {}) == Provenance("unknown", "unknown", "unknown")
    (tmp_path / "atelier-training.json").write_text(json.dumps({"manifest_digest": "e" * 64, "steps": 3}))
    assert Provenance.from_env(tmp_path, {}) == Provenance("unknown", "e" * 64, "unknown")
