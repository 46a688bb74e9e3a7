"""IAM enforcement on the local stack's moto, opt-in (`atelier local up --enforce-iam`,
`StackOptions(enforce_iam=True)`): once on, moto checks every request's signature and the caller's
IAM policies, as AWS does (with the two rules of atelier/local/iam_rules.py: `s3:prefix` on
listings, no AssumeRole of a missing role).

The local stack does not run its functions as their template roles (each is a process with the
stack's environment), so the stack itself (provisioning, the function workers, the local SageMaker,
`atelier --local`) signs as one administrator user made before enforcement starts. What the
enforcement checks is everyone else: a partner assuming its upload role, or any user a test makes.
The administrator's keys are long-lived and sit in plaintext in the stack's state file
(stack.json), as the default `local`/`local` keys do: moto's, valid on this machine's moto only.
Anyone who can reach moto can also switch enforcement off (`/moto-api/reset-auth`): it is a test
of policies, not a boundary.
"""

from __future__ import annotations

import json
import urllib.request

import boto3

ADMIN_USER = "atelier-local-admin"
ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def enforce(endpoint_url: str, region: str) -> dict[str, str]:
    """Make the administrator, switch enforcement on; the administrator's keys, as environment variables."""
    iam = boto3.client("iam", endpoint_url=endpoint_url, region_name=region,
                       aws_access_key_id="local", aws_secret_access_key="local")
    iam.create_user(UserName=ADMIN_USER)
    iam.put_user_policy(UserName=ADMIN_USER, PolicyName="everything", PolicyDocument=json.dumps(ADMIN_POLICY))
    key = iam.create_access_key(UserName=ADMIN_USER)["AccessKey"]
    switch_on(endpoint_url)
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


def switch_on(endpoint_url: str) -> None:
    """From the next request on, moto authenticates and authorises every one (none left unchecked)."""
    request = urllib.request.Request(f"{endpoint_url}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # a form type would hide the body
    urllib.request.urlopen(request, timeout=10).close()
