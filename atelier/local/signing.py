"""A throwaway C2PA signing identity for the local stack (`atelier local up --sign`): a root CA made
on the spot and an end-entity certificate it issues, in a Secrets Manager secret shaped as the
template's C2paSigningSecretArn expects (contracts/c2pa_secret.py). The root's certificate is written
beside the stack's state, to verify served images with (docs/provenance.md); nothing trusts it.

What the C2PA SDK requires of a signing certificate (trainer/serve/credentials.py checks it at start):
issued by a CA, not self-signed; key usage digitalSignature, critical; the emailProtection EKU;
subject and authority key identifiers.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from contracts import c2pa_secret

USAGES = dict.fromkeys(("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                        "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"), False)
ROOT_FILE = "c2pa-root.pem"  # under the stack's state folder


@dataclass(frozen=True)
class Identity:
    chain: bytes  # PEM: the signing certificate, then the root
    key: bytes  # PEM: the signing certificate's private key (PKCS #8, unencrypted)
    root: bytes  # PEM: the root CA's certificate, the trust anchor to verify with


def name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Atelier local")])


def certificate(subject: str, key: Any, issuer: x509.Name, issuer_key: Any, ca: bool,
                days: float = 1.0) -> x509.Certificate:
    """A CA certificate, or an end-entity one with what the C2PA SDK asks of a signer."""
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(**{**USAGES, **({"key_cert_sign": True, "crl_sign": True} if ca
                                                     else {"digital_signature": True})}), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if not ca:
        builder = (builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                  critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def pem(item: x509.Certificate) -> bytes:
    return item.public_bytes(serialization.Encoding.PEM)


def key_pem(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def local_identity(days: float = 30.0) -> Identity:
    """A new root CA and the EC P-256 signing certificate it issues."""
    root_key, signer_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    root = certificate("Atelier local root", root_key, name("Atelier local root"), root_key, ca=True, days=days)
    signer = certificate("Atelier local signer", signer_key, root.subject, root_key, ca=False, days=days)
    return Identity(chain=pem(signer) + pem(root), key=key_pem(signer_key), root=pem(root))


def create_secret(secretsmanager: Any, secret_name: str, identity: Identity) -> str:
    """The identity as the secret the template's C2paSigningSecretArn names: its ARN."""
    value = {c2pa_secret.CERTIFICATE: identity.chain.decode(), c2pa_secret.PRIVATE_KEY: identity.key.decode()}
    return secretsmanager.create_secret(Name=secret_name, SecretString=json.dumps(value))["ARN"]
