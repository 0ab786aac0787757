"""`jaxinfer convert`: a Hugging Face model directory (or hub id), or a GGUF file → our converted form,
an orbax checkpoint with the side files beside it (`jaxinfer.checkpoint`, `jaxinfer.modeldir`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxinfer import forms, gemma_library, gguf_model, weights
from jaxinfer.checkpoint import save_params
from jaxinfer.embeddings import module_folders
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import load_model
from jaxinfer.modeldir import (
    LAYOUT,
    LAYOUT_KEY,
    METHODS_KEY,
    ORBAX_DIR,
    QUANTIZED_KEY,
    SIDE_FILES,
    is_converted,
    load_config,
    model_directory,
)


def convert(
    source: Path,
    destination: Path,
    dtype: str = "auto",
    progress: weights.ProgressFn | None = None,
    quantize: str | None = None,
    gguf_file: str | None = None,
) -> Path:
    """Hugging Face directory (or hub id), or GGUF file → converted directory, stored in `dtype`
    (auto: the checkpoint's own, whatever the machine computes in; loading casts), its matrices
    packed by `quantize` ("int8", "int4", ...) if given; a GGUF file's quantized matrices as the file
    holds them (each one's method in config.json), its tokenizer as tokenizer.json or tokenizer.model.
    `gguf_file`: the GGUF file of that name in the hub repository `source`. Refuses to overwrite anything."""
    source, destination = model_directory(source, gguf_file), Path(destination).expanduser()
    if is_converted(source):
        raise JaxinferError(f"{source} is already a converted model")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise JaxinferError(f"{destination} exists and is not empty; choose a new output directory")
    config_json = load_config(source)[2]
    stored = dtype if dtype != "auto" else (weights.checkpoint_dtype(config_json) or "float32")
    # stored as the checkpoint lays it out
    model = load_model(source, stored, progress, layout="out_in", quantize=quantize)
    destination.mkdir(parents=True, exist_ok=True)
    save_params(model.params, destination / ORBAX_DIR)
    if gguf_model.is_gguf(source) or gemma_library.checkpoint_of(source):  # its tokenizer's settings too
        model.tokenizer.save(destination)
    methods = forms.methods_of(model.params)
    if gguf_model.is_gguf(source) or set(methods.values()) - {model.quantize}:  # the file's or checkpoint's own
        config_json[METHODS_KEY] = methods
    for name in SIDE_FILES:
        if source.is_dir() and (source / name).is_file():
            shutil.copy2(source / name, destination / name)
    for folder in module_folders(source) if source.is_dir() else ():  # a sentence-transformers model's pooling
        shutil.copytree(source / folder, destination / folder)
    config_json.pop("torch_dtype", None)
    quantized = {QUANTIZED_KEY: model.quantize} if model.quantize else {}
    written = {**config_json, "dtype": stored, **quantized, LAYOUT_KEY: LAYOUT}
    (destination / "config.json").write_text(json.dumps(written, indent=2))
    return destination
