"""`jaxinfer list`: the models on this machine, from the hub cache, ollama's store and a models
directory, each with the name -m takes, its size and architecture, and whether it runs (read
from its config or GGUF metadata)."""

import json
import shutil
from pathlib import Path

from cli_helpers import jaxinfer_here

DATA = Path(__file__).parent / "data" / "gguf"
GGUF = "qwen3-bpe.Q8_0.gguf"


def test_list_finds_the_hub_s_ollama_s_and_a_directory_s_models(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    hub = tmp_path / "hub"
    for repo, source in (("acme--tiny", Path(tiny("qwen3"))), ("acme--tiny-GGUF", DATA / GGUF)):
        snapshot = hub / f"models--{repo}" / "snapshots" / commit
        if source.is_dir():
            shutil.copytree(source, snapshot)
        else:
            snapshot.mkdir(parents=True)
            shutil.copy(source, snapshot)
        (hub / f"models--{repo}" / "refs").mkdir()
        (hub / f"models--{repo}" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    store = tmp_path / "ollama"
    digest = "sha256:" + "cd" * 32
    (store / "blobs").mkdir(parents=True)
    shutil.copy(DATA / GGUF, store / "blobs" / digest.replace(":", "-"))
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    models = tmp_path / "models"
    shutil.copytree(tiny("llama"), models / "llama")
    shutil.copy(DATA / GGUF, models / GGUF)
    (models / "bert").mkdir()
    (models / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (models / "notes").mkdir()  # no config.json: not a model

    listed = jaxinfer_here("list", "--models-dir", models, "--json")
    assert listed.returncode == 0, listed.stderr
    found = {(r["name"], r.get("gguf_file")): r for r in json.loads(listed.stdout)}
    assert found[("acme/tiny", None)]["architecture"] == "Qwen3ForCausalLM"
    assert found[("acme/tiny-GGUF", GGUF)]["size"] == (DATA / GGUF).stat().st_size
    assert found[("ollama:tiny:q8", None)]["runs"] and found[("ollama:tiny:q8", None)]["source"] == "ollama"
    assert found[(str(models / "llama"), None)]["architecture"] == "LlamaForCausalLM"
    assert found[(str(models / GGUF), None)]["runs"]
    bert = found[(str(models / "bert"), None)]
    assert not bert["runs"] and "unsupported architecture 'BertModel'" in bert["refused"]
    assert not any("notes" in name for name, _ in found)
    assert sum(r["source"] == "bundled" for r in found.values()) == 1
    # every model found that runs, runs by the name listed
    assert jaxinfer_here("info", "-m", "acme/tiny-GGUF", "--gguf-file", GGUF, "--json").returncode == 0
    assert jaxinfer_here("info", "-m", "ollama:tiny:q8", "--json").returncode == 0
    table = jaxinfer_here("ls", "--models-dir", models)
    assert table.returncode == 0 and "unsupported architecture 'BertModel'" in table.stdout
    assert "ollama:tiny:q8" in table.stdout and "embeds" not in table.stdout
