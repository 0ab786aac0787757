"""Our converted form's weights: an orbax checkpoint of the parameter tree as `forms.to_stored` lays
it out. Restoring goes straight into an abstract tree of forms (from the weight table,
`weights.abstract_params`): no random initialisation, each device reads its own shards, and casting to
another dtype happens on load."""

from __future__ import annotations

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

    try:
        with ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.restore(directory.resolve(), to_stored(abstract))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise JaxinferError(f"{directory}: orbax checkpoint does not match config.json ({e})") from None
    return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(stored))
