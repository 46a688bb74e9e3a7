"""Prints the package sources pip is configured with (pip.conf, PIP_* variables) as uv arguments.

`make` installs with uv, which reads no pip configuration. Given these, uv picks what pip would pick:
the best version over every index and find-links location, under the same constraint files. On a
machine whose find-links hold the CPU build of torch, that build, not a CUDA one from the index.
`python tools/pip_sources.py` asks that interpreter's pip.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's option -> uv's; each pip value is a whitespace-separated list
LISTS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
TRUE = {"1", "true", "yes", "on"}


def pip_options(listing: str) -> dict[str, str]:
    """`pip config list` output as `pip install` reads it: [global], then [install], then PIP_* variables."""
    scoped: dict[tuple[str, str], str] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.partition(".")
        if key and value:
            scoped[section, key] = ast.literal_eval(value)
    options: dict[str, str] = {}
    for section in ("global", "install", ":env:"):
        options.update({key: value for (where, key), value in scoped.items() if where == section})
    return options


def uv_arguments(options: dict[str, str]) -> list[str]:
    arguments = ["--index-strategy", "unsafe-best-match"]  # pip's: no index is preferred over another
    for key, flag in LISTS.items():
        for value in options.get(key, "").split():
            arguments += [flag, value]
    if options.get("no-index", "").lower() in TRUE:
        arguments.append("--no-index")
    return arguments


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=True)
    print(shlex.join(uv_arguments(pip_options(listing.stdout))))


if __name__ == "__main__":
    main()
