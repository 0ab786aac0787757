"""The models on this machine (`jaxinfer list`): the bundled one, the Hugging Face hub cache's,
ollama's pulled ones, and those of a models directory, each with the name `-m` takes, its size, its
architecture and whether jaxinfer runs it (read from its config.json or GGUF metadata: no weights
are read)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jaxinfer.errors import JaxinferError
from jaxinfer.modeldir import bundled_model_dir, load_config, read_json


@dataclass(frozen=True)
class Found:
    name: str  # what -m takes (with `gguf_file` beside it for a hub repository's GGUF file)
    source: str  # "bundled", "hub", "ollama", "directory"
    path: Path
    size: int  # bytes on disk
    architecture: str | None = None
    embeds: bool = False  # an embedding model: it embeds, and does not generate
    refused: str | None = None  # why jaxinfer does not run it (None: it runs)
    gguf_file: str | None = None

    def record(self) -> dict:
        return {
            "name": self.name,
            **({"gguf_file": self.gguf_file} if self.gguf_file else {}),
            "source": self.source,
            "path": str(self.path),
            "size": self.size,
            "architecture": self.architecture,
            "runs": self.refused is None,
            **({"embeds": True} if self.embeds else {}),
            **({"refused": self.refused} if self.refused else {}),
        }


def find(models_dirs: list[Path] = ()) -> list[Found]:
    """Every model found: the bundled one, the hub cache's, ollama's, then each directory's."""
    found = [_read(str(bundled_model_dir()), "bundled", bundled_model_dir())]
    found += _hub()
    found += _ollama()
    for directory in models_dirs:
        if not Path(directory).is_dir():
            raise JaxinferError(f"models_dir {directory} is not a directory", "models_dir")
        found += [_read(str(p), "directory", p) for p in models_in(Path(directory))]
    return found


def models_in(directory: Path) -> list[Path]:
    """A directory's models: its subdirectories with a config.json, its GGUF files (not a vision
    projector's, which runs nothing alone)."""
    kept = []
    for path in sorted(directory.iterdir()):
        if path.is_dir() and (path / "config.json").is_file():
            kept.append(path)
        elif path.suffix == ".gguf" and path.is_file() and "mmproj" not in path.name:
            kept.append(path)
    return kept


def _read(name: str, source: str, path: Path, gguf_file: str | None = None) -> Found:
    """What the model at `path` is, from its config (no weights read)."""
    size = disk_bytes(path / gguf_file if gguf_file else path)
    try:
        cfg = load_config(path / gguf_file if gguf_file else path)[1]
    except JaxinferError as e:
        config = read_json(path / "config.json", required=False) if path.is_dir() else {}
        architecture = (config.get("architectures") or [None])[0]
        return Found(name, source, path, size, architecture, refused=str(e), gguf_file=gguf_file)
    return Found(name, source, path, size, cfg.multimodal or cfg.architecture, cfg.headless, gguf_file=gguf_file)


def disk_bytes(path: Path) -> int:
    """A model's size on disk: its file's, or its directory's files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _hub() -> list[Found]:
    """The hub cache's model repositories (HF_HOME, HF_HUB_CACHE), at the revision `main` names (else
    the newest snapshot): one entry a repository with a config.json, one a GGUF file otherwise."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    found = []
    for repo in sorted(cache.glob("models--*")) if cache.is_dir() else ():
        snapshot = _snapshot(repo)
        if snapshot is None:
            continue
        name = repo.name.removeprefix("models--").replace("--", "/")
        if (snapshot / "config.json").is_file():
            found.append(_read(name, "hub", snapshot))
        else:
            found += [_read(name, "hub", snapshot, p.name) for p in models_in(snapshot) if p.suffix == ".gguf"]
    return found


def _snapshot(repo: Path) -> Path | None:
    main = repo / "refs" / "main"
    if main.is_file() and (repo / "snapshots" / main.read_text().strip()).is_dir():
        return repo / "snapshots" / main.read_text().strip()
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def _ollama() -> list[Found]:
    """ollama's pulled models (OLLAMA_MODELS, default ~/.ollama/models), as `ollama:NAME:TAG`: the
    library's without their host and namespace, as ollama names them."""
    from jaxinfer.modeldir import ollama_blob

    root = Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()
    found = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")) if (root / "manifests").is_dir() else ():
        host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        short = model if (host, namespace) == ("registry.ollama.ai", "library") else f"{host}/{namespace}/{model}"
        name = f"ollama:{short}:{tag}"
        try:
            blob = ollama_blob(short, tag)
        except JaxinferError as e:
            found.append(Found(name, "ollama", manifest, 0, refused=str(e)))
            continue
        found.append(_read(name, "ollama", blob))
    return found
