"""The error every layer raises for a setting it refuses, before any process starts."""
from __future__ import annotations


class ConfigError(ValueError):
    """A setting is out of range; the message names the setting, the value and what is accepted."""
