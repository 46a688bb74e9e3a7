"""The model server's settings (ServeSettings: one $SERVE_* variable a field), which the serve.environment
parameter may set: a contract, since both sides parse them with this code.

trainer/serve/settings.py reads them at start (ServeSettings.from_env) and refuses any other $SERVE_* name;
the deploy stage checks a serve.environment with the same parser before it creates a model
(core/settings.py), so a misspelt name or a bad value fails there, at once, not in a deployment that rolls
back minutes later. What each setting does: trainer/serve/settings.py and levers.py.
"""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "SERVE_"
COMPILE_MODES = ("off", "default", "max-autotune")  # $SERVE_COMPILE (trainer/serve/levers.py)
SCHEDULERS = ("default", "dpmpp")  # $SERVE_SCHEDULER
# SageMaker's ContainerDefinition.Environment (botocore's EnvironmentValue): a value's longest
MAX_VALUE_CHARS = 1024


@dataclass(frozen=True)
class ServeSettings:
    """The request bounds (each bounds the time or memory one request can take) and the speed levers."""

    max_steps: int = 200
    max_side: int = 2048
    max_images: int = 4
    max_body_bytes: int = 65536
    max_prompt_chars: int = 1000
    max_guidance: float = 50.0
    scheduler: str = "default"  # the saved pipeline's own
    fuse_qkv: bool = False
    channels_last: bool = False
    compile: str = "default"  # on a GPU only (trainer/serve/levers.py); bench/RESULTS.md has what each lever gave
    cuda_graphs: bool = True
    warmup_images: tuple[int, ...] = (1,)
    batch_window_ms: float = 0.0
    max_batch: int = 8
    cpu_threads: int | None = None  # torch's intra-op threads; None: torch's default (every core)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ServeSettings":
        """$SERVE_<FIELD> overrides each default; a value that does not parse, or a $SERVE_* name that is
        no field, fails at start."""
        names = {f"SERVE_{field.name.upper()}" for field in fields(cls)}
        strangers = sorted(name for name in environ if name.startswith(PREFIX) and name not in names)
        if strangers:
            raise ValueError(f"unknown server settings {strangers}; known: {', '.join(sorted(names))}")
        values = {}
        for field in fields(cls):
            name = f"SERVE_{field.name.upper()}"
            if name in environ:
                values[field.name] = _setting(field, name, environ[name].strip())
        return cls(**values)


VARIABLES = frozenset(f"{PREFIX}{field.name.upper()}" for field in fields(ServeSettings))
CHOICES = {"scheduler": SCHEDULERS, "compile": COMPILE_MODES}
FLAGS = {"1": True, "true": True, "0": False, "false": False}


def _setting(field, name: str, text: str):
    if field.name in CHOICES:
        if text not in CHOICES[field.name]:
            raise ValueError(f"${name} must be one of {', '.join(CHOICES[field.name])}, got {text!r}")
        return text
    if field.type in (bool, "bool"):
        if text.lower() not in FLAGS:
            raise ValueError(f"${name} must be 1 or 0, got {text!r}")
        return FLAGS[text.lower()]
    if field.name == "warmup_images":
        return tuple(_positive(name, part, int) for part in text.split(","))
    kind = float if field.type in (float, "float") else int
    return _positive(name, text, kind, zero=field.name == "batch_window_ms")


def _positive(name: str, text: str, kind: type, zero: bool = False) -> int | float:
    """A positive number (or zero, where `zero`), else ValueError naming the variable."""
    wanted = f"${name} must be a {'non-negative' if zero else 'positive'} {kind.__name__}, got {text!r}"
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(wanted) from None
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(wanted)
    return value


def unknown(names) -> list[str]:
    """The names among `names` that are not the server's variables, sorted."""
    return sorted(set(names) - VARIABLES)
