"""`atelier recipe show | set FILE`: the recipe the stack trains, judges and serves with (docs/recipe.md).

`show` prints the current recipe as the JSON file `set` takes, its digest and uri on stderr; `set` checks a
file as the functions will read it (contracts.recipe_file, core.recipes.check), stores it and makes it
current, on condition that the current one is still the one read (`--expect DIGEST`, default: the one
current when the command starts). A bad file is refused with its reason, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atelier import client
from contracts.recipe_file import RecipeError, parse
from core import recipes


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    recipe = commands.add_parser("recipe", help="the recipe: what is trained, how a model is judged and served").add_subparsers(
        dest="recipe_command", required=True)
    show = recipe.add_parser("show", help="print the current recipe (JSON; its digest and uri on stderr)")
    show.add_argument("--json", action="store_true", help="one JSON object: uri, digest and the recipe")
    show.set_defaults(func=cmd_recipe_show)
    put = recipe.add_parser("set", help="check a recipe file, store it and make it the current one")
    put.add_argument("file", type=Path, help="a recipe, as `atelier recipe show` prints it")
    put.add_argument("--expect", metavar="DIGEST",
                     help="refuse unless the current recipe has this digest (default: the one current now)")
    put.add_argument("--json", action="store_true", help="one JSON object: uri, digest and the previous digest")
    put.set_defaults(func=cmd_recipe_set)


def _names(args: argparse.Namespace) -> tuple[str, str]:
    outputs = client.stack_outputs(args.stack)
    return outputs["PipelineTableName"], outputs["ModelsBucketName"]


def cmd_recipe_show(args: argparse.Namespace) -> int:
    current = recipes.current(*_names(args))
    document = current.recipe.model_dump(mode="json")
    if args.json:
        print(json.dumps({"uri": current.uri, "digest": current.digest, "recipe": document}))
        return 0
    print(f"recipe {current.digest} ({current.uri})", file=sys.stderr)
    print(json.dumps(document, indent=2, sort_keys=True))
    return 0


def cmd_recipe_set(args: argparse.Namespace) -> int:
    try:
        new = parse(args.file.read_bytes())
        recipes.check(new)  # before the stack is asked for anything
        table, bucket = _names(args)
        expected = args.expect or recipes.current(table, bucket).digest
        stored = recipes.put(new, table, bucket, expected_digest=expected)
    except RecipeError as error:
        raise client.PipelineError(f"{args.file}: {error}") from None
    except OSError as error:
        raise client.PipelineError(f"{args.file}: {error.strerror or error}") from None
    if args.json:
        print(json.dumps({"uri": stored.uri, "digest": stored.digest, "previous": expected}))
        return 0
    print(f"recipe {stored.digest} is current (was {expected})", file=sys.stderr)
    print(stored.uri)
    return 0
