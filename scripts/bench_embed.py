"""Embedding throughput, jaxinfer against sentence-transformers (torch, CPU) on the same weights:
a random Qwen3-Embedding-0.6B-like model (its widths, `--layers` of them; the last token pooled and
normalised, as the real one), the same texts, alternated rounds in one sitting. The vectors are
checked equal before anything is timed.

    python scripts/bench_embed.py --layers 8 --texts 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

WORDS = "the capital of france is paris while rome is in italy and tokyo is the capital of japan".split()


def make(directory: Path, layers: int) -> Path:
    """A sentence-transformers directory: a random Qwen3 body of Qwen3-Embedding-0.6B's widths."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from test_embeddings import padded_tokenizer
    from tiny_models import make_model

    body = make_model(
        directory / "body",
        "qwen3",
        lambda d: padded_tokenizer(d, eos=True),
        init_std=0.02,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    modules = [Transformer(str(body), max_seq_length=512), Pooling(1024, pooling_mode="lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory / "st"))
    return directory / "st"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from jaxinfer import embeddings
    from jaxinfer.embeddings import Asked
    from jaxinfer.loading import load_model

    random.seed(0)
    texts = [" ".join(random.choice(WORDS) for _ in range(random.randint(10, 60))) for _ in range(args.texts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make(Path(tmp), args.layers)
        st = SentenceTransformer(str(path), device="cpu")
        model = load_model(path)
        ids, skips = embeddings.tokenized(model, Asked(texts), 1024)
        tokens = sum(map(len, ids))

        def ours():
            return embeddings.embed(model.params, model.config, model.pooler, ids, skips)

        def theirs():
            with torch.inference_mode():
                return st.encode(texts, batch_size=args.batch_size)

        gap = float(np.abs(ours() - theirs()).max())
        assert gap < 1e-4, f"the vectors differ by {gap}"
        rates = {"jaxinfer": [], "sentence-transformers": []}
        for _ in range(args.rounds):
            for name, run in (("jaxinfer", ours), ("sentence-transformers", theirs)):
                start = time.perf_counter()
                run()
                rates[name].append(tokens / (time.perf_counter() - start))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(
        json.dumps(
            {
                "texts": args.texts,
                "tokens": tokens,
                "layers": args.layers,
                "max_abs_gap": gap,
                "tok_s": {name: round(m) for name, m in medians.items()},
                "ratio": round(medians["jaxinfer"] / medians["sentence-transformers"], 2),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
