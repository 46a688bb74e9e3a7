"""What the CLI says before it does anything: help for every command, option and argument, and the
`local up` banner as a terminal shows it."""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from atelier.cli import local_up_banner, parser


def commands(top: argparse.ArgumentParser, path: tuple[str, ...] = ("atelier",)) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the CLI, the top one included, with its command path."""
    yield path, top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def test_the_walk_reaches_every_command() -> None:
    paths = {" ".join(path) for path, _ in commands(parser())}
    # the walk must not pass by finding nothing: a few known leaves at every depth
    assert {"atelier", "atelier status", "atelier local up", "atelier dlq redrive", "atelier evalset add"} <= paths
    assert len(paths) > 25


def test_every_option_and_argument_has_help() -> None:
    missing = [f"{' '.join(path)} {action.option_strings[0] if action.option_strings else action.dest}"
               for path, command in commands(parser()) for action in command._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and (not action.help or action.help == argparse.SUPPRESS)]
    assert missing == []


def test_every_command_has_help() -> None:
    missing = [f"{' '.join(path)} {choice.dest}" for path, command in commands(parser()) for action in command._actions
               if isinstance(action, argparse._SubParsersAction) for choice in action._choices_actions
               if not choice.help]
    undescribed = [" ".join(path) for path, command in commands(parser()) for action in command._actions
                   if isinstance(action, argparse._SubParsersAction) and set(action.choices) != {
                       c.dest for c in action._choices_actions}]
    assert (missing, undescribed) == ([], [])


def test_the_local_up_banner_keeps_text_in_brackets() -> None:
    shown = io.StringIO()
    terminal = Console(file=shown, width=60, force_terminal=False)

    for line in local_up_banner(12, 5, Path("/state/[x]/logs"), 5100):
        terminal.print(line, soft_wrap=True)  # as `local up` prints them

    text = shown.getvalue()
    assert "(samconfig.toml [local] and events/env.json)" in text
    assert "logs in /state/[x]/logs" in text
    assert "  sam build && sam local invoke --config-env local IngestFunction -e events/ingest_s3_put.json\n" in text
