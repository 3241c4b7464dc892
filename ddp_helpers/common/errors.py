"""The error every layer raises for a setting it refuses, before any process starts."""
from __future__ import annotations

import unicodedata


def one_line(text: str) -> str:
    r"""text with every control character shown escaped (a newline as \n), so an error stays one line."""
    if text.isprintable():
        return text
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


class ConfigError(ValueError):
    """A setting is out of range; the message names the setting, the value and what is accepted (on one line:
    a value's newlines and other control characters are shown escaped)."""

    def __init__(self, message: object = "", *rest: object):
        super().__init__(one_line(str(message)), *rest)
