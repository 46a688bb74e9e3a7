"""The model server's own environment variables, which the ServeEnvironment parameter may set.

trainer/serve/settings.py reads them (ServeSettings, one variable a field) and refuses any other $SERVE_*
name at start; the deploy stage checks a ServeEnvironment against the same list before it creates
a model, so a misspelt name fails there, at once, not in a deployment that rolls back minutes later.
tests/trainer/test_serve.py holds the two lists equal.
"""

PREFIX = "SERVE_"
VARIABLES = frozenset({
    "SERVE_MAX_STEPS", "SERVE_MAX_SIDE", "SERVE_MAX_IMAGES", "SERVE_MAX_BODY_BYTES", "SERVE_MAX_PROMPT_CHARS",
    "SERVE_MAX_GUIDANCE", "SERVE_SCHEDULER", "SERVE_FUSE_QKV", "SERVE_CHANNELS_LAST", "SERVE_COMPILE",
    "SERVE_CUDA_GRAPHS", "SERVE_WARMUP_IMAGES", "SERVE_BATCH_WINDOW_MS", "SERVE_MAX_BATCH", "SERVE_CPU_THREADS",
})
# SageMaker's ContainerDefinition.Environment (botocore's EnvironmentValue): a value's longest
MAX_VALUE_CHARS = 1024


def unknown(names) -> list[str]:
    """The names among `names` that are not the server's variables, sorted."""
    return sorted(set(names) - VARIABLES)
