"""The jobs' parsers, built from the recipe (contracts.recipe, contracts.recipe_jobs): one flag per field of a
job's options, with the field's type, default, choices, group and help, and the parsed values checked by the
same model, so a check fails the job as an argparse error (exit status 2) with the check's own message.

SageMaker passes every value as a string: a flag's `true`/`false` (and `auto`, where a job decides by
itself) is parsed by the recipe's own `flag`, the function the start-training function checks with too.
"""

import argparse
import types
import typing

from pydantic import BaseModel, ValidationError

from contracts.recipe import also_names, auto_or_flag, dest, first_error, flag


def boolean(text: str) -> bool:
    """A hyperparameter string as a bool (SageMaker passes every value as a string)."""
    try:
        return flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def auto_or_boolean(text: str) -> bool | str:
    try:
        return auto_or_flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def argument_type(field) -> dict:
    """argparse's `type` or `choices` for a recipe field (a string field needs neither)."""
    validators = {getattr(item, "func", None) for item in field.metadata}
    if auto_or_flag in validators:
        return {"type": auto_or_boolean}
    if flag in validators:
        return {"type": boolean}
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None: a flag without a default
        annotation = next(member for member in typing.get_args(annotation) if member is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    return {"type": annotation} if annotation in (int, float) else {}


def add_options(parser: argparse.ArgumentParser, options: type[BaseModel]) -> None:
    """One flag per field of `options`, in the argparse group its field names (a group already made is reused)."""
    groups = {group.title: group for group in parser._action_groups}
    for field in options.model_fields.values():
        title = (field.json_schema_extra or {}).get("group")
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups[title] if title else parser
        names = [f"--{name}" for name in (field.alias, *also_names(field))]
        target.add_argument(*names, dest=dest(field), default=field.default,
                            help=field.description.replace("%", "%%"), **argument_type(field))


def checked(parser: argparse.ArgumentParser, options: type[BaseModel], args: argparse.Namespace) -> argparse.Namespace:
    """`args`, once `options` has checked them; else argparse's error: the message, exit status 2."""
    try:
        options.model_validate({field.alias: getattr(args, dest(field)) for field in options.model_fields.values()})
    except ValidationError as error:
        parser.error(first_error(error))
    return args
