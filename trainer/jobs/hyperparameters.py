"""Hyperparameter values the jobs' parsers share: SageMaker passes every value as a string, so a flag's
`true`/`false` (and `auto`, where a job decides by itself) is parsed here, once, for every job.
"""

import argparse


def boolean(text: str) -> bool:
    """A hyperparameter string as a bool (SageMaker passes every value as a string)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def auto_or_boolean(text: str) -> bool | str:
    return "auto" if text.lower() == "auto" else boolean(text)
