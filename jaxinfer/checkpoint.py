"""Our converted form's weights: an orbax checkpoint of the parameter tree as `forms.to_stored` lays
it out. Restoring goes straight into an abstract tree of forms (from the weight table,
`weights.abstract_params`): no random initialisation, each device reads its own shards, and casting to
another dtype happens on load."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from jaxinfer.errors import JaxinferError
from jaxinfer.forms import to_stored


def save_params(params: dict, directory: Path) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory.resolve(), to_stored(params))  # orbax needs an absolute path
        checkpointer.wait_until_finished()


def restore_params(directory: Path, abstract: dict) -> dict:
    """The tree of forms `abstract` (ShapeDtypeStructs) describes, read from `directory`."""
    import orbax.checkpoint as ocp

    _check_side_files(directory)
    checkpointer = ocp.StandardCheckpointer()
    undo = quiet_leftovers()
    try:
        stored = checkpointer.restore(directory.resolve(), to_stored(abstract))
    except Exception as e:  # orbax and TensorStore raise many kinds; each is worded below
        raise JaxinferError(_worded(directory, e)) from None  # the leftovers stay quiet from here on
    checkpointer.close()
    undo()
    return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(stored))


# orbax's and TensorStore's words for a file that is damaged, not one that disagrees with config.json
_CORRUPT = ("DATA_LOSS", "FAILED_PRECONDITION", "Error decoding", "Error reading", "Invalid JSON", "Unterminated")


def _worded(directory: Path, e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if any(word in str(e) for word in _CORRUPT):
        return f"{directory}: the orbax checkpoint is damaged (truncated or corrupt): {first[:300]}"
    return f"{directory}: the orbax checkpoint does not match config.json ({first[:300]})"


def quiet_leftovers():
    """A failed restore leaves orbax's reads of the other arrays to be finalised, each failing into a
    closed event loop: Python prints every one as an ignored exception (a damaged array index: 3,000
    lines after our one), and TensorStore's callbacks print theirs through sys.excepthook, some while
    the restore is still failing. Those, and only those, are dropped from the restore on; the returned
    function puts the hooks back (after a restore that succeeded)."""
    import sys

    def leftover(value, where=None) -> bool:
        code = getattr(where, "cr_code", None)
        return "orbax" in getattr(code, "co_filename", "") or "Event loop is closed" in str(value)

    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def unraisable_hook(unraisable) -> None:
        if not leftover(unraisable.exc_value, unraisable.object):
            previous_unraisable(unraisable)

    def except_hook(kind, value, traceback) -> None:
        if not leftover(value):
            previous_except(kind, value, traceback)

    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook
    # and asyncio logs each read's task as it is collected ("Task exception was never retrieved"):
    # when, depends on the garbage collector (one run in several printed one after our line)
    unretrieved = logging.getLogger("asyncio")
    never_retrieved = _NeverRetrieved()
    unretrieved.addFilter(never_retrieved)

    def undo() -> None:
        sys.unraisablehook, sys.excepthook = previous_unraisable, previous_except
        unretrieved.removeFilter(never_retrieved)

    return undo


class _NeverRetrieved(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


def _check_side_files(directory: Path) -> None:
    """The checkpoint's JSON side files parse: a damaged one named, not reported as a mismatch."""
    import json

    for name in ("_METADATA", "_CHECKPOINT_METADATA", "_sharding"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise JaxinferError(f"{path}: damaged (not valid JSON: {e}); convert the model again") from None
