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
