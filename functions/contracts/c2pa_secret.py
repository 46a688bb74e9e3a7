"""The C2PA signing identity of the endpoint (docs/provenance.md, "Output credentials"): a Secrets
Manager secret the template's C2paSigningSecretArn names. The deploy stage puts its ARN in every
model's container environment; the model server (trainer/serve/credentials.py) reads the secret once, at
start, with the endpoint's execution role, and fails to start when it cannot."""

from __future__ import annotations

ENVIRONMENT = "ATELIER_C2PA_SECRET"  # the container's variable: the secret's ARN
# The secret's SecretString: a JSON object of two PEM texts
CERTIFICATE = "certificate"  # the signing certificate, then its intermediates (the root may be left out)
PRIVATE_KEY = "private_key"  # its unencrypted private key (EC P-256/384/521, Ed25519 or RSA)
