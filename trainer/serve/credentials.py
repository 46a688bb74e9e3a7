"""C2PA Content Credentials for generated images: a signed manifest inside each PNG, when configured.

The signing identity comes from one of two places. On AWS, $ATELIER_C2PA_SECRET (set by the deploy
stage from the template's C2paSigningSecretArn) names a Secrets Manager secret, read once at start
with the container's credentials (boto3; AWS_ENDPOINT_URL points it at the local stack's moto): a
JSON object {"certificate", "private_key"} of PEM texts (contracts/c2pa_secret.py). Otherwise
$ATELIER_C2PA_CERT names a PEM file with the signing certificate first, then its intermediates
(the root may be left out), and $ATELIER_C2PA_KEY the PEM file of its private key. The key is
unencrypted, EC P-256/P-384/P-521, Ed25519 or RSA, which picks ES256/ES384/ES512, Ed25519 or PS256.
Configured: every PNG gets a manifest (claim v2) with a `c2pa.created` action of digital source type
trainedAlgorithmicMedia and an `atelier.provenance` assertion holding the model id, the manifest
digest and the attribution report's URI, the values of the PNG's text chunks. Nothing set: images
are not signed. A secret that cannot be read, one file variable without the other, both ways at
once, an unreadable file or credentials the C2PA SDK refuses (a self-signed or expired certificate,
a key that does not match it) fail at start, not on the first request: never unsigned images instead.

Signing reaches nothing: no timestamp authority, no OCSP, no remote manifests.
"""

import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import c2pa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from PIL import Image

from contracts import c2pa_secret

TRAINED_ALGORITHMIC_MEDIA = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
PROVENANCE_LABEL = "atelier.provenance"
# No thumbnail (the image itself is the asset, and one would add about half its size); nothing fetched.
SIGN_SETTINGS = {
    "builder": {"thumbnail": {"enabled": False}},
    "verify": {"ocsp_fetch": False, "remote_manifest_fetch": False},
}
CURVES = {
    "secp256r1": c2pa.C2paSigningAlg.ES256,
    "secp384r1": c2pa.C2paSigningAlg.ES384,
    "secp521r1": c2pa.C2paSigningAlg.ES512,
}


class CredentialsError(ValueError):
    """The configured signing certificate or key cannot sign C2PA manifests."""


@dataclass(frozen=True)
class Credentials:
    """A PEM certificate chain, its PEM private key and the signing algorithm the key implies."""

    chain: bytes
    key: bytes
    algorithm: c2pa.C2paSigningAlg

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Credentials | None":
        """The secret $ATELIER_C2PA_SECRET names, or the files $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY
        name, checked by one signature; None when none is set."""
        secret = environ.get(c2pa_secret.ENVIRONMENT)
        cert_path, key_path = environ.get("ATELIER_C2PA_CERT"), environ.get("ATELIER_C2PA_KEY")
        if secret and (cert_path or key_path):
            raise CredentialsError(f"set ${c2pa_secret.ENVIRONMENT} or $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY, not both")
        if secret:
            chain, key = _read_secret(secret)
        elif not cert_path and not key_path:
            return None
        elif not cert_path or not key_path:
            raise CredentialsError("set both $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY, or neither")
        else:
            chain, key = _read(cert_path, "ATELIER_C2PA_CERT"), _read(key_path, "ATELIER_C2PA_KEY")
        credentials = cls(chain, key, signing_algorithm(key))
        _check(credentials)
        return credentials


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise CredentialsError(f"${name}: cannot read {path}: {error.strerror}") from None


def _read_secret(arn: str) -> tuple[bytes, bytes]:
    """The PEM chain and key of the secret `arn`, read with the container's role (the secret's region)."""
    import boto3  # only a server that signs from a secret needs the AWS SDK
    from botocore.exceptions import BotoCoreError, ClientError

    name = c2pa_secret.ENVIRONMENT
    region = arn.split(":")[3] if arn.count(":") >= 6 else None
    try:
        value = boto3.client("secretsmanager", region_name=region).get_secret_value(SecretId=arn).get("SecretString")
    except (BotoCoreError, ClientError) as error:
        raise CredentialsError(f"${name}: cannot read the secret {arn}: {error}") from None
    try:
        fields = json.loads(value)
        return fields[c2pa_secret.CERTIFICATE].encode(), fields[c2pa_secret.PRIVATE_KEY].encode()
    except (TypeError, ValueError, KeyError, AttributeError):
        raise CredentialsError(f"${name}: the secret {arn} is not a JSON object of PEM texts "
                               f'"{c2pa_secret.CERTIFICATE}" and "{c2pa_secret.PRIVATE_KEY}"') from None


def signing_algorithm(key_pem: bytes) -> c2pa.C2paSigningAlg:
    """The C2PA algorithm for a PEM private key: ES256/384/512 by curve, Ed25519, PS256 for RSA."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise CredentialsError(f"$ATELIER_C2PA_KEY is not an unencrypted PEM private key: {error}") from None
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name in CURVES:
        return CURVES[key.curve.name]
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return c2pa.C2paSigningAlg.ED25519
    if isinstance(key, rsa.RSAPrivateKey):
        return c2pa.C2paSigningAlg.PS256
    raise CredentialsError(f"C2PA cannot sign with a {type(key).__name__}; use EC P-256/384/521, Ed25519 or RSA")


def _check(credentials: Credentials) -> None:
    """Sign a one-pixel PNG, so that credentials the SDK refuses fail at start."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    try:
        sign_png(buffer.getvalue(), {"model_id": "", "manifest": "", "attribution": ""}, credentials)
    except c2pa.C2paError as error:
        raise CredentialsError(f"the C2PA signing credentials are refused: {error}") from None


def manifest_definition(provenance: Mapping[str, str]) -> dict:
    """The C2PA manifest for one generated image: created by a trained model, and which one."""
    return {
        "claim_generator_info": [{"name": "atelier"}],
        "assertions": [
            {"label": "c2pa.actions", "data": {"actions": [{
                "action": "c2pa.created",
                "digitalSourceType": TRAINED_ALGORITHMIC_MEDIA,
                "softwareAgent": {"name": provenance["model_id"]},
            }]}},
            {"label": PROVENANCE_LABEL, "data": dict(provenance)},
        ],
    }


def sign_png(png: bytes, provenance: Mapping[str, str], credentials: Credentials) -> bytes:
    """The PNG with a signed C2PA manifest embedded; its other chunks (the text chunks) are kept."""
    info = c2pa.C2paSignerInfo(alg=credentials.algorithm, sign_cert=credentials.chain,
                               private_key=credentials.key, ta_url=None)
    signed = io.BytesIO()
    # A signer and builder per image: they are single-use native objects, and requests run in threads.
    with (
        c2pa.Context.from_dict(SIGN_SETTINGS) as context,
        c2pa.Signer.from_info(info) as signer,
        c2pa.Builder(manifest_definition(provenance), context) as builder,
    ):
        builder.sign(signer, "image/png", io.BytesIO(png), signed)
    return signed.getvalue()
