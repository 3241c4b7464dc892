"""The error every layer raises for a setting it refuses, before any process starts, and the settings it names.

A message names each setting with a `Setting` (formatted into it as marked text), so that it can be said in two
words: Python's (`TrainConfig.resume_from=None`, str(error)) in a notebook, the flags' (`--resume-from`) on the
command line (cli/words.py). Nothing reads setting names back out of prose. Lists are said one way (`listed`).
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Union

# Private-use characters around a setting inside a message (a repr escapes them, so a value never holds one).
_OPEN, _SEP, _CLOSE = "\ue000", "\ue001", "\ue002"
NAME_ONLY = "<name only>"  # a Setting's value when the message names the setting, not a value of it


def listed(words: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 0', 'ranks 0 and 1', 'ranks 0, 1 and 2'."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + listed([str(r) for r in ranks])


def one_line(text: str) -> str:
    r"""text with every control character shown escaped (a newline as \n), so an error stays one line."""
    if text.isprintable():
        return text
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


@dataclass(frozen=True)
class Setting:
    """A setting named in a message: `name`, or `name=value`; `lead` "set " makes it an instruction, "or " an
    alternative; its `owner` in Python: a class is written before the name (`TrainConfig.port=0`), a function
    ("launch()") around it (`launch(port=0)`)."""

    name: str
    value_repr: str = NAME_ONLY  # repr(value): what Python shows, and what the command line's words parse
    lead: str = ""
    owner: str = ""

    def __format__(self, spec: str) -> str:
        return _OPEN + _SEP.join((self.name, self.value_repr, self.lead, self.owner)) + _CLOSE

    def in_python(self) -> str:
        """The setting as Python spells it: `TrainConfig.resume_from=None`, `set max_steps=3`, `batch_size`."""
        text = self.name if self.value_repr == NAME_ONLY else f"{self.name}={self.value_repr}"
        if self.owner.endswith("()"):
            return f"{self.lead}{self.owner[:-2]}({text})"
        return self.lead + (f"{self.owner}.{text}" if self.owner else text)


def setting(name: str, *value: Any, lead: str = "", owner: str = "") -> Setting:
    """A setting to format into a message: setting("max_steps") names it, setting("max_steps", 3) gives a value."""
    return Setting(name, repr(value[0]) if value else NAME_ONLY, lead, owner)


def message_parts(marked: str) -> List[Union[str, Setting]]:
    """A marked message as its plain text and its settings, in order."""
    parts: List[Union[str, Setting]] = []
    head, *rest = marked.split(_OPEN)
    parts.append(head)
    for chunk in rest:
        fields, text = chunk.split(_CLOSE, 1)
        parts += [Setting(*fields.split(_SEP)), text]
    return [p for p in parts if p != ""]


def render(marked: str, words: Callable[[Setting], str] = Setting.in_python) -> str:
    """A marked message with each setting said in `words` (Python's by default), on one line."""
    return one_line("".join(p if isinstance(p, str) else words(p) for p in message_parts(marked)))


class SaysSettings:
    """An error whose message names settings: str() says them in Python; render(words) in other words."""

    marked: str

    def render(self, words: Callable[[Setting], str]) -> str:
        """The message with its settings said by `words` (e.g. the command line's flags)."""
        return render(getattr(self, "marked", str(self)), words)


class ConfigError(SaysSettings, ValueError):
    """A setting is refused: the message names the setting, the value and what is accepted (on one line: a value's
    newlines and other control characters are shown escaped). `field`, `value` and `accepted` hold them apart when
    one setting is refused (see refused())."""

    field = None
    value: Any = None
    accepted = ""

    def __init__(self, message: object = "", *rest: object):
        self.marked = str(message)
        super().__init__(render(self.marked), *rest)


def refused(field: str, value: Any, accepted: str, owner: str = "TrainConfig") -> ConfigError:
    """The error for one refused setting: `TrainConfig.field=value is not accepted: accepted`."""
    error = ConfigError(f"{setting(field, value, owner=owner)} is not accepted: {accepted}")
    error.field, error.value, error.accepted = field, value, render(accepted)  # accepted: in Python's words
    return error
