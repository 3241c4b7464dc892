"""What the command line says: settings named by their flags (`--resume-from PATH`), not as TrainConfig fields.

The checks in engine/ and data/ speak Python (`TrainConfig.resume_from=None`), which is right in a notebook;
cli/train.py passes each of their messages through as_flags() once, so a terminal user reads the flag to change.
The names come from TrainConfig's table (engine/config.py), as the flags themselves do.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import typing
from typing import Any, Dict

from ..common.errors import one_line
from ..engine.config import TrainConfig

_VALUE = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\([^()]*\)|[\w.+-]+"  # a repr: quoted, a tuple, a word or number


def _flag_names() -> Dict[str, bool]:
    """Every setting the CLI has a flag for -> whether None means "auto" for it (an optional bool)."""
    hints = typing.get_type_hints(TrainConfig)
    names = {f.name: hints[f.name] == typing.Optional[bool] for f in dataclasses.fields(TrainConfig)}
    names["start_method"] = False  # a flag of the CLI's own, named by the launcher's messages
    return names


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_text(name: str, text: str, auto_is_none: bool) -> Any:
    """The flag's argument for a Python repr, as typed in a shell (None is returned for an unset setting)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if value is None:
        return "auto" if auto_is_none else None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, str):
        return shlex.quote(value)
    return text  # a number as the message wrote it


def as_flags(message: str) -> str:
    """message with `TrainConfig.x=V`, `x=V` and multi-word names `x_y` written as the CLI's `--x V`, `--x-y`."""
    names = _flag_names()
    alternatives = "|".join(sorted(names, key=len, reverse=True))

    def assignment(m: re.Match) -> str:
        verb, name, text = m.group(1), m.group(2), m.group(3)
        value = _value_text(name, text, names[name])
        if value is None:  # an unset setting has no flag on the command line: "set x=None" is "leave out --x"
            return f"{'or ' if verb == 'or ' else ''}leave out {_flag(name)}" if verb else f"no {_flag(name)}"
        lead = {"set ": "use ", "or ": "or "}.get(verb or "", "")
        return f"{lead}{_flag(name)} {value}".rstrip()

    out = re.sub(rf"(?<![\w./-])(set |or )?(?:TrainConfig\.)?({alternatives})=({_VALUE})", assignment, message)
    # Bare names: only those with an underscore (one-word ones such as "seed" or "epochs" are also plain words).
    multi = "|".join(n for n in sorted(names, key=len, reverse=True) if "_" in n)
    out = re.sub(rf"(?<![\w./-])(?:TrainConfig\.)?({multi})(?![\w/=-])", lambda m: _flag(m.group(1)), out)
    out = re.sub(rf"(?<![\w./-])TrainConfig\.({alternatives})(?![\w=])", lambda m: _flag(m.group(1)), out)
    return one_line(out)  # a value's newline, unquoted again above, must not split the one-line error
