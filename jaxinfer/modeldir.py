"""A model directory: where it is (a path, a Hugging Face hub id, the bundled model), its JSON files,
and whether it is our converted form."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from importlib import resources
from pathlib import Path

from jaxinfer import gemma_library
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.families import config_from_hf, moe
from jaxinfer.models import DEFAULT as DEFAULT_MODEL

ORBAX_DIR = "params"  # a converted model keeps its orbax checkpoint here, beside config.json
# config.json of a converted model stored quantized ("int8", "int4", ...); a GGUF file's most common method
QUANTIZED_KEY = "jaxinfer_quantize"
# config.json of a converted GGUF file: each quantized matrix's method by its path (`forms.methods_of`)
METHODS_KEY = "jaxinfer_methods"
# config.json of a converted model: the layout of the tree it holds. 2: a DeltaNet's channels grouped
# by key head (`jaxinfer.layers.delta_net.channel_order`); before, none written and the checkpoint's order.
LAYOUT_KEY, LAYOUT = "jaxinfer_layout", 2
# Everything a run needs besides the weights.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    # a sentence-transformers model's (its modules' folders beside: `embeddings.module_folders`)
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
)


def read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise JaxinferError(f"{path} not found: is {path.parent} a model directory?")
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise JaxinferError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise JaxinferError(f"{path}: expected a JSON object")
    return data


def is_converted(model_dir: Path) -> bool:
    return (model_dir / ORBAX_DIR).is_dir()


# A Hugging Face checkpoint's files: (its index, its one file), safetensors first, then Flax's msgpack
CHECKPOINT_FILES = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("flax_model.msgpack.index.json", "flax_model.msgpack"),
)


def tensor_names(model_dir: Path) -> list[str]:
    """The names of a directory's safetensors tensors, from its index or its one file's header
    (nothing else is read); none where it has neither, or they cannot be read (reading the weights
    says why)."""
    from safetensors import SafetensorError, safe_open

    index, single = CHECKPOINT_FILES[0]
    try:
        if (model_dir / index).is_file():
            return list(json.loads((model_dir / index).read_text())["weight_map"])
        if (model_dir / single).is_file():
            with safe_open(str(model_dir / single), framework="np") as handle:
                return list(handle.keys())
    except (ValueError, KeyError, TypeError, SafetensorError, OSError):
        pass
    return []


def bundled_model_dir() -> Path:
    """The default model's directory, wherever jaxinfer is installed (it is package data)."""
    return Path(str(resources.files("jaxinfer.models") / DEFAULT_MODEL))


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")  # "org/name", or "org/name@revision"
OLLAMA = re.compile(r"ollama:(?P<name>[\w./-]+?)(:(?P<tag>[\w.-]+))?")  # "ollama:llama3.2:1b"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]  # what loading reads: no .bin, .gguf, ...


def hub_files(listed: list[str]) -> list[str]:
    """What to download of a hub repository holding `listed`: its safetensors; where it has none, its
    Flax msgpack (a Flax-only repository, from before transformers 5) or its gemma-library orbax
    checkpoint (the hub's JAX Gemma repositories) beside the tokenizer and JSON files."""
    if any(name.endswith(".safetensors") for name in listed):
        return HUB_FILES
    if any(Path(name).name.startswith("flax_model.msgpack") for name in listed):
        return [*HUB_FILES, "flax_model.msgpack*"]
    orbax = {str(Path(name).parent) for name in listed if Path(name).name in gemma_library.ORBAX_MARKS}
    if not orbax:
        return HUB_FILES
    return [*HUB_FILES, *("*" if folder == "." else f"{folder}/*" for folder in sorted(orbax))]


def model_directory(path: str | Path | None, gguf_file: str | None = None) -> Path:
    """A local directory (or GGUF file) as given; else a Hugging Face hub id, from the local hub cache
    (HF_HOME, HF_HUB_CACHE) or downloaded when the network and HF_HUB_OFFLINE allow: its model files,
    or only its GGUF file `gguf_file` (a GGUF repository holds one per quantization); none: the
    bundled model."""
    if path is not None and (named := OLLAMA.fullmatch(str(path))):
        return ollama_blob(named["name"], named["tag"] or "latest")
    if path is None:
        if gguf_file:
            raise JaxinferError("gguf_file names a file of a hub repository: give the repository too", "gguf_file")
        return bundled_model_dir()
    local = Path(path).expanduser()
    if local.exists() or not HUB_ID.fullmatch(str(path)):
        if gguf_file:
            raise JaxinferError(f"gguf_file names a file of a hub repository; {path} is not a hub id", "gguf_file")
        return gemma_library.home(local)
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = str(path).partition("@")
    if gguf_file:
        where = dict(revision=revision or None, filename=gguf_file)
        fetch = functools.partial(hf_hub_download, repo_id)
        path = f"{path}, file {gguf_file}"
    else:
        where = dict(revision=revision or None, allow_patterns=HUB_FILES)
        fetch = functools.partial(snapshot_download, repo_id)
    try:
        return Path(fetch(local_files_only=True, **where))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise JaxinferError(
                f"{path} is not a local directory, nor in the Hugging Face cache {constants.HF_HUB_CACHE} "
                "(HF_HUB_OFFLINE is set)"
            ) from None
    try:
        if not gguf_file:  # what the repository holds decides what is fetched
            from huggingface_hub import HfApi

            where["allow_patterns"] = hub_files(HfApi().list_repo_files(repo_id, revision=revision or None))
        return Path(fetch(**where))  # with huggingface_hub's progress bars
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise JaxinferError(
            f"{path} is not a local directory, nor in the Hugging Face cache {constants.HF_HUB_CACHE}, and downloading "
            "it failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})"
        ) from None


def ollama_blob(name: str, tag: str) -> Path:
    """The GGUF file ollama keeps for `name:tag` (`ollama pull`'s): its manifest names the model layer's
    blob, under OLLAMA_MODELS (default ~/.ollama/models). Names without a host are the library's."""
    import os

    root = Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()
    parts = name.split("/")
    parts = parts if "." in parts[0] else ["registry.ollama.ai", *(["library"] if len(parts) == 1 else []), *parts]
    manifest = root.joinpath("manifests", *parts, tag)
    if not manifest.is_file():
        raise JaxinferError(f"ollama has no {name}:{tag} in {root} (no {manifest}): ollama pull {name}:{tag}")
    layers = read_json(manifest).get("layers") or ()
    model = [
        str(layer.get("digest", ""))
        for layer in layers
        if isinstance(layer, dict) and str(layer.get("mediaType", "")).endswith(".model")
    ]
    if not model:
        raise JaxinferError(f"{manifest}: the ollama manifest names no model layer")
    return root / "blobs" / model[0].replace(":", "-")


def load_config(path: str | Path | None = None, gguf_file: str | None = None) -> tuple[Path, ModelConfig, dict]:
    """(directory, config, config.json as read) of a model directory or hub id (`gguf_file`: its GGUF file
    of that name); no path: the bundled model. A GGUF file stands for a directory: the config.json its
    metadata describes (`jaxinfer.gguf_config`)."""
    from jaxinfer import gguf_config, gguf_model

    model_dir = model_directory(path, gguf_file)
    if gguf_model.is_gguf(model_dir):
        file = gguf_model.open_gguf(model_dir)
        method = gguf_model.quantized_by(file)
        config_json = {**gguf_config.config_json(file), **({QUANTIZED_KEY: method} if method else {})}
        config_json[METHODS_KEY] = gguf_model.methods_by_path(file, config_from_hf(config_json))
    elif model_dir.is_file():
        holder = model_dir.parent if (model_dir.parent / "config.json").is_file() else None
        raise JaxinferError(
            f"{model_dir} is a file, and not a GGUF file: -m takes the model's directory (config.json and the weights)"
            + (f": {holder}" if holder else "")
        )
    elif not model_dir.is_dir():
        raise JaxinferError(f"model directory {model_dir} does not exist")
    elif checkpoint := gemma_library.checkpoint_of(model_dir):
        config_json = gemma_library.config_json(model_dir, checkpoint)
    else:
        config_json = read_json(model_dir / "config.json")
        if not is_converted(model_dir) and any(name.endswith(moe.FUSED_TENSOR) for name in tensor_names(model_dir)):
            config_json[moe.FUSED_KEY] = True
    cfg = config_from_hf(config_json)
    if (model_dir / "modules.json").is_file() or gguf_config.POOLING_KEY in config_json:
        cfg = replace(cfg, headless=True)  # an embedding model (sentence-transformers', a GGUF file's): its body
    return model_dir, cfg, config_json
