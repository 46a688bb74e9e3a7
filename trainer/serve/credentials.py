"""C2PA Content Credentials for generated images: a signed manifest inside each PNG, when configured.

$ATELIER_C2PA_CERT names a PEM file with the signing certificate first, then its intermediates
(the root may be left out); $ATELIER_C2PA_KEY names the PEM file of its private key (unencrypted;
EC P-256/P-384/P-521, Ed25519 or RSA, which picks ES256/ES384/ES512, Ed25519 or PS256). Both set:
every PNG gets a manifest (claim v2) with a `c2pa.created` action of digital source type
trainedAlgorithmicMedia and an `atelier.provenance` assertion holding the model id, the manifest
digest and the attribution report's URI, the values of the PNG's text chunks. Neither set: images
are not signed. One set, an unreadable file or credentials the C2PA SDK refuses (a self-signed or
expired certificate, a key that does not match it) fail at start, not on the first request.

Nothing here reaches the network: no timestamp authority, no OCSP, no remote manifests.
"""

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import c2pa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from PIL import Image

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
        """The files $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY name, checked by one signature; None when neither is set."""
        cert_path, key_path = environ.get("ATELIER_C2PA_CERT"), environ.get("ATELIER_C2PA_KEY")
        if not cert_path and not key_path:
            return None
        if not cert_path or not key_path:
            raise CredentialsError("set both $ATELIER_C2PA_CERT and $ATELIER_C2PA_KEY, or neither")
        chain, key = _read(cert_path, "ATELIER_C2PA_CERT"), _read(key_path, "ATELIER_C2PA_KEY")
        credentials = cls(chain, key, signing_algorithm(key))
        _check(credentials)
        return credentials


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise CredentialsError(f"${name}: cannot read {path}: {error.strerror}") from None


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
