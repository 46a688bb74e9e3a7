"""Named domain failures: a handler turns each into a batch item failure or a recorded outcome."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contracts.messages import UploadRef


class ConfigError(RuntimeError):
    """A required setting is missing or malformed in the function's environment."""


class BadMessage(ValueError):
    """A queue message or event does not match its contract; retrying cannot help."""


class RejectedUpload(ValueError):
    """An upload is not a usable training sample; `reason` is a stable, short code."""

    def __init__(self, reason: str, detail: str = "", upload: UploadRef | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.upload = upload  # the upload with what S3 said of it, when learnt before the refusal
