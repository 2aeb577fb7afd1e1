"""Reading settings from the environment: one meaning of a boolean for every layer (graphs re-export it)."""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(value: str | bool) -> bool:
    """'1/true/yes/on' or '0/false/no/off' (any case) as a bool, else a ValueError."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(f"{value!r} is not a boolean (use true or false)")


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable `name` (`parse_bool`); unset or blank is `default`. A ValueError names it."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return parse_bool(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}: {err}") from None
