"""The one exception type a user ever sees: its message is a complete, one-line instruction."""

from __future__ import annotations

import re
from typing import Mapping


class JaxinferError(Exception):
    """Bad input or environment. The CLI prints `error: <message>` and exits non-zero.

    The library speaks parameters: a message names them as Python does (`max_tokens`), and `names`
    lists those it names, so a front end can say them in its own words (`worded`: the CLI's flags)."""

    def __init__(self, message: str, *names: str):
        super().__init__(message)
        self.names = names

    def worded(self, words: Mapping[str, str]) -> str:
        """The message with each parameter it names replaced by its word in `words` (where it has one)."""
        message = str(self)
        if not self.names:
            return message
        pattern = r"(?<![\w-])(" + "|".join(map(re.escape, self.names)) + r")(?!\w)"
        return re.sub(pattern, lambda m: words.get(m.group(1), m.group(1)), message)


# A request's fields (a batch line's, an HTTP body's), checked in one line each


def refuse_unknown(item: dict, known: set[str], where: str = "") -> None:
    unknown = sorted(set(item) - known)
    if unknown:
        raise JaxinferError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}{where}")


def boolean(item: dict, name: str, default: bool) -> bool:
    """A field that must be true or false."""
    value = item.get(name, default)
    if not isinstance(value, bool):
        raise JaxinferError(f'"{name}" must be true or false', name)
    return value
