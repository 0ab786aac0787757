"""The converted form: an orbax checkpoint of the parameter tree, with the HF config and tokenizer
files beside it. Restoring goes straight into the abstract tree from the weight table: no random
initialisation, and casting to another dtype happens on load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxinfer import weights
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import ORBAX_DIR, QUANTIZED_KEY, is_converted, load_model, model_directory, read_json

# Everything a run needs besides the weights.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def save_params(params: dict, directory: Path) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory.resolve(), params)  # orbax needs an absolute path
        checkpointer.wait_until_finished()


def restore_params(directory: Path, abstract: dict) -> dict:
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(directory.resolve(), abstract)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise JaxinferError(f"{directory}: orbax checkpoint does not match config.json ({e})") from None


def convert(
    source: Path,
    destination: Path,
    dtype: str = "auto",
    progress: weights.ProgressFn | None = None,
    quantize: str | None = None,
) -> Path:
    """Hugging Face directory (or hub id) → converted directory, stored in `dtype` (auto: the
    checkpoint's own, whatever the machine computes in; loading casts), its matrices packed by
    `quantize` ("int8", "int4") if given. Refuses to overwrite anything."""
    source, destination = model_directory(source), Path(destination).expanduser()
    if is_converted(source):
        raise JaxinferError(f"{source} is already a converted model")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise JaxinferError(f"{destination} exists and is not empty; choose a new output directory")
    config_json = read_json(source / "config.json")
    stored = dtype if dtype != "auto" else (weights.checkpoint_dtype(config_json) or "float32")
    # stored as the checkpoint lays it out
    model = load_model(source, stored, progress, layout="out_in", quantize=quantize)
    destination.mkdir(parents=True, exist_ok=True)
    save_params(model.params, destination / ORBAX_DIR)
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
    config_json.pop("torch_dtype", None)
    quantized = {QUANTIZED_KEY: quantize} if quantize else {}
    (destination / "config.json").write_text(json.dumps({**config_json, "dtype": stored, **quantized}, indent=2))
    return destination
