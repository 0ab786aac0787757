"""The one exception type a user ever sees: its message is a complete, one-line instruction."""


class JaxinferError(Exception):
    """Bad input or environment. The CLI prints `error: <message>` and exits non-zero."""
