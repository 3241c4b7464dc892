"""What the command line says: settings named by their flags (`--resume-from PATH`), not as TrainConfig fields.

The checks in engine/, data/ and ranks/ name each setting with a common.errors.Setting, which str() says in Python
(`TrainConfig.resume_from=None`), right in a notebook; for_flags() says the same error with the flag to change,
for a terminal user. The flags come from TrainConfig's table (engine/config.py), as the parser's do.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import shlex
import typing
from typing import Any, Dict, Optional

from ..common.errors import NAME_ONLY, SaysSettings, Setting, one_line
from ..engine.config import TrainConfig


@functools.lru_cache(maxsize=1)
def _flag_names() -> Dict[str, bool]:
    """Every setting the CLI has a flag for -> whether None means "auto" for it (an optional bool)."""
    hints = typing.get_type_hints(TrainConfig)
    names = {f.name: hints[f.name] == typing.Optional[bool] for f in dataclasses.fields(TrainConfig)}
    names["start_method"] = False  # a flag of the CLI's own, named by the launcher's messages
    return names


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argument(value_repr: str, auto_is_none: bool) -> Optional[str]:
    """The flag's argument for a value's repr, as typed in a shell (None for an unset setting)."""
    try:
        value: Any = ast.literal_eval(value_repr)
    except (ValueError, SyntaxError):
        return value_repr
    if value is None:
        return "auto" if auto_is_none else None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, str):
        return shlex.quote(value)
    return value_repr  # a number as Python writes it


def as_flag(named: Setting) -> str:
    """One setting as the command line says it: `--resume-from PATH`, `use --max-steps 5`, `leave out --x`."""
    names = _flag_names()
    if named.name not in names:  # no flag for it (a launch() argument): Python's words
        return named.in_python()
    if named.value_repr == NAME_ONLY:
        return named.lead + _flag(named.name)
    argument = _argument(named.value_repr, names[named.name])
    if argument is None:  # an unset setting has no flag on the command line: "set x=None" is "leave out --x"
        return {"set ": "leave out ", "or ": "or leave out "}.get(named.lead, "no ") + _flag(named.name)
    lead = {"set ": "use ", "or ": "or "}.get(named.lead, named.lead)
    return f"{lead}{_flag(named.name)} {argument}"


def for_flags(error: BaseException) -> str:
    """The error's message with each setting it names said as the command line's flag."""
    if isinstance(error, SaysSettings):
        return error.render(as_flag)
    return one_line(str(error))
