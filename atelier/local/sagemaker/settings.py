"""How the local SageMaker runs: where its state lives, which command an image runs, its timings."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# `docker run <image> train|serve` runs the image's ENTRYPOINT with that argument; locally the
# entrypoint is a command line, by default the project's container module.
DEFAULT_ENTRYPOINT = (sys.executable, "-m", "trainer.container")

Entrypoints = Mapping[str, Sequence[str]] | Callable[[str], Sequence[str]] | None


@dataclass(frozen=True)
class Settings:
    """How the local SageMaker runs: where state lives, which command an image runs, timings."""

    state_dir: Path
    region: str = "us-east-1"
    account_id: str = "123456789012"  # moto's default account
    entrypoints: Entrypoints = None
    cwd: Path = REPO_ROOT
    checkpoint_sync_seconds: float = 5.0
    stop_grace_seconds: float = 120.0  # SageMaker's SIGTERM-to-SIGKILL window
    startup_timeout_seconds: float = 300.0
    invoke_timeout_seconds: float = 60.0  # SageMaker's invocation timeout
    alarm_poll_seconds: float = 1.0  # how often a deployment reads its rollback alarms while baking
    metrics_flush_seconds: float = 1.0  # endpoint metrics go to CloudWatch this often (SageMaker: 60)

    def arn(self, kind: str, name: str) -> str:
        # SageMaker lower-cases the name inside its ARNs.
        return f"arn:aws:sagemaker:{self.region}:{self.account_id}:{kind}/{name.lower()}"

    def command(self, image: str, mode: str) -> list[str]:
        """The argv that stands in for `docker run <image> <mode>`."""
        if callable(self.entrypoints):
            entrypoint = self.entrypoints(image)
        elif self.entrypoints is not None and image in self.entrypoints:
            entrypoint = self.entrypoints[image]
        else:
            entrypoint = DEFAULT_ENTRYPOINT
        return [*entrypoint, mode]
