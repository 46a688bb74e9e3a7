"""trainer.serve.credentials: C2PA manifests signed into served PNGs, read back with the C2PA SDK's Reader.

The certificates are made here, at test time, by the local stack's builder (atelier/local/signing.py):
a root CA and an end-entity signing certificate with what the SDK requires of one: issued by a CA, not
self-signed; key usage digitalSignature, critical; the emailProtection EKU; subject and authority key
identifiers.
"""

import base64
import http.client
import io
import json
import os
import struct
import threading
import zlib
from pathlib import Path

import boto3
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from moto import mock_aws
from PIL import Image

from atelier.local.signing import Identity, certificate, create_secret, key_pem, pem
from atelier.local.signing import name as subject
from tests.support import c2pa_assertions as assertions
from tests.support import read_c2pa
from trainer.serve.credentials import TRAINED_ALGORITHMIC_MEDIA, Credentials, CredentialsError
from trainer.serve.generation import load_pipeline
from trainer.serve.protocol import Generation, png_bytes
from trainer.serve.server import InferenceServer
from trainer.serve.settings import Provenance, ServeSettings

PROVENANCE = Provenance(model_id="atelier-0123456789abcdef0123", manifest="9f2c" * 16,
                        attribution="s3://models/training/job-1/output/attribution.json")
GENERATION = Generation(prompt="a red dog", num_inference_steps=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path | str]:
    """A throwaway root CA and signing certificate, as the files an operator would mount."""
    root = tmp_path_factory.mktemp("c2pa")
    root_key, signer_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    root_certificate = certificate("Atelier test root", root_key, subject("Atelier test root"), root_key, ca=True)
    signer = certificate("Atelier test signer", signer_key, root_certificate.subject, root_key, ca=False)
    files = {
        "chain": pem(signer) + pem(root_certificate),
        "key": key_pem(signer_key),
        "root": pem(root_certificate),
        "root_key": key_pem(root_key),
    }
    for name, data in files.items():
        (root / f"{name}.pem").write_bytes(data)
    return {name: root / f"{name}.pem" for name in files} | {"anchors": files["root"].decode()}


@pytest.fixture(scope="module")
def credentials(pki) -> Credentials:
    return Credentials.from_env({"ATELIER_C2PA_CERT": str(pki["chain"]), "ATELIER_C2PA_KEY": str(pki["key"])})


def image() -> Image.Image:
    return Image.new("RGB", (64, 48), (200, 30, 40))


def replace_text_chunk(png: bytes, keyword: bytes, value: bytes) -> bytes:
    """The PNG with one tEXt chunk's value replaced, its CRC made right again: a well-formed edit."""
    position = 8
    while position < len(png):
        length, kind = struct.unpack(">I4s", png[position:position + 8])
        data = png[position + 8:position + 8 + length]
        end = position + 12 + length
        if kind == b"tEXt" and data.split(b"\0", 1)[0] == keyword:
            data = keyword + b"\0" + value
            chunk = struct.pack(">I4s", len(data), kind) + data + struct.pack(">I", zlib.crc32(kind + data))
            return png[:position] + chunk + png[end:]
        position = end
    raise AssertionError(f"no tEXt chunk {keyword!r}")


# ---------------------------------------------------------------- signing


def test_a_signed_png_carries_the_provenance_in_a_trusted_c2pa_manifest(pki, credentials):
    signed = png_bytes(image(), GENERATION, 7, PROVENANCE, credentials)

    state, manifest, failures = read_c2pa(signed, pki["anchors"])
    assert (state, failures) == ("Trusted", [])
    assert assertions(manifest)["atelier.provenance"] == {
        "model_id": PROVENANCE.model_id, "manifest": PROVENANCE.manifest, "attribution": PROVENANCE.attribution}
    assert assertions(manifest)["c2pa.actions.v2"]["actions"] == [{
        "action": "c2pa.created", "digitalSourceType": TRAINED_ALGORITHMIC_MEDIA,
        "softwareAgent": {"name": PROVENANCE.model_id}}]


def test_signing_keeps_the_text_chunks_and_the_pixels(credentials):
    unsigned = Image.open(io.BytesIO(png_bytes(image(), GENERATION, 7, PROVENANCE)))
    signed = Image.open(io.BytesIO(png_bytes(image(), GENERATION, 7, PROVENANCE, credentials)))

    assert signed.text == unsigned.text
    assert signed.text["atelier:model-id"] == PROVENANCE.model_id
    assert signed.tobytes() == unsigned.tobytes()


def test_a_png_altered_after_signing_fails_validation(pki, credentials):
    signed = png_bytes(image(), GENERATION, 7, PROVENANCE, credentials)
    # The same length and a right CRC: a PNG reader sees nothing wrong, only the C2PA data hash does.
    altered = replace_text_chunk(signed, b"atelier:model-id", b"atelier-ffffffffffffffffffff")

    assert Image.open(io.BytesIO(altered)).text["atelier:model-id"] == "atelier-ffffffffffffffffffff"
    state, _, failures = read_c2pa(altered, pki["anchors"])
    assert (state, failures) == ("Invalid", ["assertion.dataHash.mismatch"])


def test_without_credentials_nothing_is_signed(pki):
    assert Credentials.from_env({}) is None
    assert read_c2pa(png_bytes(image(), GENERATION, 7, PROVENANCE), pki["anchors"]) is None


@pytest.fixture(scope="module")
def pipeline(trained):
    return load_pipeline(trained["model_dir"])


def invoke(pipeline, credentials: Credentials, payload: dict) -> tuple[int, dict]:
    """One JSON request to a server on a free local port that signs with `credentials`."""
    settings = ServeSettings(max_steps=2, max_side=64, max_images=2)
    with InferenceServer("127.0.0.1", 0, settings, PROVENANCE, pipeline, credentials=credentials) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            connection = http.client.HTTPConnection(*server.server_address, timeout=120)
            connection.request("POST", "/invocations", body=json.dumps(payload),
                               headers={"Content-Type": "application/json", "Accept": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            server.shutdown()


def test_the_endpoint_signs_every_image_it_serves(pipeline, pki, credentials):
    status, body = invoke(pipeline, credentials, {"prompt": "a red dog", "num_inference_steps": 1, "num_images": 2})

    assert status == 200
    for encoded in body["images"]:
        state, manifest, failures = read_c2pa(base64.b64decode(encoded), pki["anchors"])
        assert (state, failures) == ("Trusted", [])
        assert assertions(manifest)["atelier.provenance"]["model_id"] == PROVENANCE.model_id


def test_a_signing_failure_while_serving_is_a_500_that_says_why(pipeline, pki, credentials):
    # GIVEN credentials that passed at start but can no longer sign (here: another key)
    broken = Credentials(credentials.chain, pki["root_key"].read_bytes(), credentials.algorithm)

    status, body = invoke(pipeline, broken, {"prompt": "a red dog", "num_inference_steps": 1})

    assert status == 500
    assert "signature does not match" in body["error"]


# ---------------------------------------------------------------- configuration


def test_a_certificate_without_its_key_fails_at_start(pki):
    with pytest.raises(CredentialsError, match="both"):
        Credentials.from_env({"ATELIER_C2PA_CERT": str(pki["chain"])})


def test_a_missing_file_fails_at_start(pki, tmp_path):
    with pytest.raises(CredentialsError, match=r"\$ATELIER_C2PA_KEY: cannot read"):
        Credentials.from_env({"ATELIER_C2PA_CERT": str(pki["chain"]), "ATELIER_C2PA_KEY": str(tmp_path / "none.pem")})


def test_a_self_signed_certificate_fails_at_start(pki):
    # The root CA signing for itself: C2PA accepts only end-entity certificates issued by a CA.
    with pytest.raises(CredentialsError, match="self-signed"):
        Credentials.from_env({"ATELIER_C2PA_CERT": str(pki["root"]), "ATELIER_C2PA_KEY": str(pki["root_key"])})


def test_a_key_that_does_not_match_the_certificate_fails_at_start(pki):
    with pytest.raises(CredentialsError, match="refused"):
        Credentials.from_env({"ATELIER_C2PA_CERT": str(pki["chain"]), "ATELIER_C2PA_KEY": str(pki["root_key"])})


# ---------------------------------------------------------------- the signing secret (AWS: C2paSigningSecretArn)

SECRET = "ATELIER_C2PA_SECRET"


@pytest.fixture
def secretsmanager():
    with mock_aws():
        yield boto3.client("secretsmanager")


def test_the_signing_secret_is_read_at_start_and_signs(pki, secretsmanager):
    identity = Identity(chain=pki["chain"].read_bytes(), key=pki["key"].read_bytes(), root=pki["root"].read_bytes())
    arn = create_secret(secretsmanager, "atelier/c2pa-signing", identity)

    credentials = Credentials.from_env({SECRET: arn})

    state, manifest, failures = read_c2pa(png_bytes(image(), GENERATION, 7, PROVENANCE, credentials), pki["anchors"])
    assert (state, failures) == ("Trusted", [])
    assert assertions(manifest)["atelier.provenance"]["model_id"] == PROVENANCE.model_id


def test_a_secret_that_does_not_exist_fails_at_start(secretsmanager):
    missing = "arn:aws:secretsmanager:us-east-1:123456789012:secret:atelier/none-AbCdEf"

    with pytest.raises(CredentialsError, match=r"\$ATELIER_C2PA_SECRET: cannot read the secret .*ResourceNotFound"):
        Credentials.from_env({SECRET: missing})


def test_a_container_without_aws_credentials_fails_at_start(monkeypatch):
    # as a network-isolated SageMaker container would: no credentials, so the secret cannot be read
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # a fresh process: boto3's default session keeps the credentials an earlier test in this worker resolved
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)

    with pytest.raises(CredentialsError, match="cannot read the secret .*Unable to locate credentials"):
        Credentials.from_env({SECRET: "arn:aws:secretsmanager:us-east-1:123456789012:secret:atelier/s-AbCdEf"})


def test_a_secret_that_is_not_a_signing_identity_fails_at_start(secretsmanager):
    arn = secretsmanager.create_secret(Name="atelier/pem", SecretString="-----BEGIN CERTIFICATE-----")["ARN"]

    with pytest.raises(CredentialsError, match='not a JSON object of PEM texts "certificate" and "private_key"'):
        Credentials.from_env({SECRET: arn})


def test_a_secret_and_files_at_once_fail_at_start(pki):
    with pytest.raises(CredentialsError, match="not both"):
        Credentials.from_env({SECRET: "arn:aws:secretsmanager:us-east-1:123456789012:secret:s-AbCdEf",
                              "ATELIER_C2PA_CERT": str(pki["chain"]), "ATELIER_C2PA_KEY": str(pki["key"])})

