"""The command's options generated from gpuvfio.options: one typer option per declared option.

A command names the option sets it takes as parameters whose default is ``options(SET,
"command")``; ``@from_table`` puts the set's options in that place of the signature typer
reads (flag, help, metavar and default from the table) and hands the function one dict per
set, keyed by the options' names (a ``--no-X`` switch given back as ``X``), each value checked
against its declaration (gpuvfio.options.checked), for the services that read them.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from gpuvfio.errors import InputError
from gpuvfio.numbers import DIGITS, shown
from gpuvfio.options import Option, OptionSet, checked, cli_flag


__all__ = ["Group", "options", "from_table", "flag_of", "annotation_of"]

_TYPES = {"str": str, "path": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class Group:
    """The options of one set a command takes."""

    options: tuple[Option, ...]


def options(option_set: OptionSet, command: str) -> Group:
    return Group(option_set.for_command(command))


def flag_of(name: str) -> str:
    """How the command spells a declared option (for help texts that name another one)."""
    return cli_flag(name)


# Numbers as an admin writes them, in ASCII digits (typer's own parsing through pydantic answered
# "Input should be a valid integer, unable to parse string as an integer", and took "nan").
_WHOLE = re.compile(rf"[+-]?[0-9]{{1,{DIGITS}}}", re.ASCII)
_NUMBER = re.compile(rf"[+-]?(?:[0-9]{{1,{DIGITS}}}(?:\.[0-9]{{0,{DIGITS}}})?|\.[0-9]{{1,{DIGITS}}})(?:[eE][+-]?[0-9]{{1,3}})?",
                     re.ASCII)


def _parser(pattern: re.Pattern, convert, what: str):
    def parse(text):
        """The option's value; a default from the table is handed over as it is, already typed."""
        if not isinstance(text, str):
            return text
        if not pattern.fullmatch(text.strip()):
            raise typer.BadParameter(f"{shown(text)} is not {what}")
        return convert(text)

    return parse


_PARSERS = {"int": _parser(_WHOLE, int, f"a whole number (at most {DIGITS} digits)"),
            "float": _parser(_NUMBER, float, "a number")}


def annotation_of(option: Option):
    """The typer annotation for ``option``: its flag, help and metavar (and gpuvfio's number parsing)."""
    kind = _TYPES[option.kind]
    if option.default is None and not option.required and kind is not bool:
        kind = Optional[kind]
    text = option.off_help if option.negated else option.text(flag_of)
    return Annotated[kind, typer.Option(*option.flags, help=text, metavar=option.metavar,
                                        parser=_PARSERS.get(option.kind))]


def _default(option: Option):
    if option.required:
        return ...
    return False if option.negated else option.default


def from_table(func):
    """``func`` with each ``options(...)`` parameter replaced by that set's typer options."""
    signature = inspect.signature(func, eval_str=True)
    groups: dict[str, Group] = {}
    parameters = []
    for parameter in signature.parameters.values():
        if isinstance(parameter.default, Group):
            groups[parameter.name] = parameter.default
            parameters += [inspect.Parameter(o.parameter, inspect.Parameter.KEYWORD_ONLY, default=_default(o),
                                             annotation=annotation_of(o)) for o in parameter.default.options]
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(func)
    def wrapper(**kwargs):
        for name, group in groups.items():
            kwargs[name] = {o.name: (not kwargs.pop(o.parameter)) if o.negated else kwargs.pop(o.parameter)
                            for o in group.options}
            # Each value within the table's kind, bounds, choices and pattern before anything runs,
            # a dry run as the run (a service checks again where it takes the value).
            for option in group.options:
                if kwargs[name][option.name] is not None:
                    checked(option, kwargs[name][option.name])
        return func(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=parameters)
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


