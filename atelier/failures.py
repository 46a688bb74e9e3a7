"""What an AWS SDK failure means to the person at the keyboard: one sentence that says what is
wrong and what to run. `atelier` prints it instead of a traceback and exits 2."""

from __future__ import annotations

from pathlib import Path

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)


def explain(error: BotoCoreError | ClientError, local: bool, state_dir: Path) -> str | None:
    """The sentence for a failure a user can fix; None for one that is a bug (its traceback helps)."""
    if isinstance(error, (EndpointConnectionError, ConnectTimeoutError)):
        url = error.kwargs.get("endpoint_url", "the endpoint")
        if local:
            return (f"nothing answers at {url}: the local stack of {state_dir} is not running; start it with "
                    f"`atelier --state-dir {state_dir} local up` (it stops when that process does)")
        return (f"cannot reach {url}: check the network and AWS_ENDPOINT_URL / AWS_DEFAULT_REGION, "
                "or pass --local for a running `atelier local up`")
    if isinstance(error, NoRegionError):
        return ("no AWS region is set: `export AWS_DEFAULT_REGION=us-east-1` (or `aws configure`), "
                "or pass --local for a running `atelier local up`")
    if isinstance(error, NoCredentialsError):
        return "no AWS credentials: `aws configure` (or `aws sso login`), or pass --local for a running `atelier local up`"
    if isinstance(error, ClientError):
        details = error.response.get("Error", {})
        code, message = details.get("Code", "Unknown"), details.get("Message", "")
        if code == "NoSuchBucket":
            bucket = details.get("BucketName", "")
            return (f"bucket {bucket or '(named in the request)'} does not exist here: check the s3:// URI "
                    "(`aws s3 ls` lists the buckets you can read)")
        return f"AWS refused {error.operation_name}: {code}: {message}"
    return None


def elapsed(seconds: float) -> str:
    """A duration as people say it: 45 s, 3 min 12 s, 2 h 5 min."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
