import os

# Tests must not write to the user's cache, nor read programs compiled by another version.
os.environ.setdefault("JAXINFER_CACHE_DIR", "")

import pytest

from tiny_models import make_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch, tokenizer="bpe") → path of a saved random-weight HF model (built once per session)."""
    built = {}

    def get(arch: str = "llama", tokenizer: str = "bpe", **overrides):
        key = (arch, tokenizer, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_model(tmp_path_factory.mktemp(f"{arch}-{tokenizer}"), arch, tokenizer, **overrides)
        return built[key]

    return get
