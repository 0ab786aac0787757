"""The Hugging Face Flax test fixtures (tests/data/flax/), made and answered by transformers' own Flax
models, recorded once: transformers 5 dropped Flax, so the suite cannot ask it again.

    pip install --no-deps --target /tmp/transformers4 "transformers==4.57.1"
    python scripts/make_flax_fixtures.py /tmp/transformers4    # rewrites tests/data/flax/

transformers 4.57 pins tokenizers < 0.23.1 and huggingface-hub < 1.0 at import; neither is used to
build a model and save it, so the pins are lifted in that copy (this script does it). For each family
a tiny random `Flax*ForCausalLM` (the suite's BPE tokenizer's vocabulary) is saved as its
`save_pretrained` writes it (config.json, flax_model.msgpack), beside the tokenizer, and its logits
over a prompt and its greedy continuation are kept in logits.npz: `tests/test_flax.py` holds
jaxinfer to them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "flax"
IDS = [0, 5, 9, 33, 2, 17, 80, 4, 61, 200, 383, 7]
GREEDY = 24
FAMILIES = {
    "llama": ("LlamaConfig", "FlaxLlamaForCausalLM", {}),
    "gemma": ("GemmaConfig", "FlaxGemmaForCausalLM", {"head_dim": 16}),
}


def main() -> None:
    target = Path(sys.argv[1])
    pins = target / "transformers" / "dependency_versions_table.py"
    pins.write_text(
        pins.read_text()
        .replace('"tokenizers>=0.22.0,<=0.23.0"', '"tokenizers>=0.22.0"')
        .replace('"huggingface-hub>=0.34.0,<1.0"', '"huggingface-hub>=0.34.0"')
    )
    sys.path[:0] = [str(target), str(ROOT / "tests")]
    import jax
    import transformers
    from tiny_models import SIZES, bpe_tokenizer

    assert transformers.__version__.startswith("4."), transformers.__version__
    for name, (config_class, model_class, extra) in FAMILIES.items():
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        config = getattr(transformers, config_class)(vocab_size=384, **SIZES, bos_token_id=0, eos_token_id=1, **extra)
        model = getattr(transformers, model_class)(config, seed=0, dtype=jax.numpy.float32)
        # random init gives near-uniform logits: widen the matrices so the argmax is decisive, as tiny_models does
        rng = np.random.default_rng(0)
        model.params = jax.tree.map(
            lambda a: rng.normal(0, 0.2, a.shape).astype(np.float32) if a.ndim > 1 else np.asarray(a), model.params
        )
        model.save_pretrained(out)
        bpe_tokenizer(out)
        logits = np.asarray(model(np.asarray([IDS])).logits[0], np.float32)
        greedy = []  # the model's own forward over the whole text each step (its generate wants an EOS)
        for _ in range(GREEDY):
            greedy.append(int(np.asarray(model(np.asarray([IDS + greedy])).logits)[0, -1].argmax()))
        np.savez(out / "logits.npz", ids=IDS, logits=logits, greedy=greedy, transformers=transformers.__version__)
        print(name, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
