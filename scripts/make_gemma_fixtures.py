"""The gemma-library test fixtures (tests/data/gemma-library/), made and answered by Google DeepMind's
`gemma` library's own Flax modules, recorded once:

    pip install --no-deps --target /tmp/gemma-lib "gemma==3.3.0"
    python scripts/make_gemma_fixtures.py /tmp/gemma-lib    # rewrites tests/data/gemma-library/

The library's package imports kauldron, whose pinned stack (TensorFlow, clu, a jax older than ours)
does not install beside this project's; its layers (`gemma.gm.nn._modules`: Embedder, Block with its
Attention and FeedForward, `_layers.RMSNorm`) and its checkpoint reformatting (`gm.ckpts._compat`)
import only flax and jax, so this script imports those modules alone (their packages' __init__ files
skipped, kauldron's two names they use stubbed) and composes them as the library's `Transformer`
does (embed, blocks, final norm, tied decode, the final soft-cap). Each model's constants are the
library's own model class's (`gm.nn.Gemma2_2B` ...), named in FAMILIES; its sizes are tiny.

Each directory is named after the library model whose constants it has (the name jaxinfer reads the
family from where the sizes are none of the library's), holds the orbax checkpoint as the library
saves it (Gemma 1 and 2 in the FLAT layout the Kaggle releases have, `transformer/layer_0/attn/...`;
Gemma 3 NESTED, as `gm.ckpts.save_params` writes `model.init`'s tree), a Gemma-style sentencepiece
tokenizer.model beside it (ids 0 pad, 1 eos, 2 bos; <start_of_turn>, <end_of_turn>), and logits.npz:
the logits over a prompt and the greedy continuation. `tests/test_gemma_library.py` holds jaxinfer
to them.
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "gemma-library"
GREEDY = 24
VOCAB = 512  # the embedding's rows; the tokenizer's 400 ids fewer, as Gemma's 256128 rows to 256000 ids
# name → (the library class whose constants these are, its constants, tiny sizes, layout, prompt length)
FAMILIES = {
    # the library's Gemma 1 7B (gemma 2.x's TransformerConfig.gemma_7b): multi-head (one qkv_einsum);
    # no post norms, soft-caps or sliding layers
    "gemma-7b-tiny": (
        "TransformerConfig.gemma_7b",
        dict(version=1, post_norms=False, softcap=None, final_softcap=None, window=None, transpose=False),
        dict(layers=2, embed=64, heads=4, kv_heads=4, head_dim=16, hidden=128),
        "flat",
        12,
    ),
    # gm.nn.Gemma2_2B: GQA, post norms, soft-caps 50 / 30, every other layer sliding (4096), its
    # gating_einsum not transposed ([2, embed, hidden]: the 9B and 27B transpose it)
    "gemma2-2b-tiny": (
        "Gemma2_2B",
        dict(version=2, post_norms=True, softcap=50.0, final_softcap=30.0, window=4096, transpose=False),
        dict(layers=2, embed=64, heads=4, kv_heads=2, head_dim=16, hidden=96),
        "flat",
        12,
    ),
    # gm.nn.Gemma3_1B: q/k norms, five sliding layers (512) to a global one, rope bases 10000 / 10⁶;
    # a 600-token prompt so the sliding layers drop keys
    "gemma3-1b-tiny": (
        "Gemma3_1B",
        dict(version=3, post_norms=True, softcap=None, final_softcap=None, window=512, transpose=True),
        dict(layers=7, embed=64, heads=4, kv_heads=1, head_dim=16, hidden=128),
        "nested",
        600,
    ),
}


def import_library(target: Path):
    """The library's layer and checkpoint modules, without its packages' __init__ files (they import kauldron)."""
    for package in ("gemma", "gemma.gm", "gemma.gm.nn", "gemma.gm.math", "gemma.gm.ckpts", "gemma.gm.typing"):
        module = types.ModuleType(package)
        module.__path__ = [str(target / package.replace(".", "/"))]
        sys.modules[package] = module
    kauldron, typing = types.ModuleType("kauldron"), types.ModuleType("kauldron.typing")
    kauldron.kd = types.SimpleNamespace(nn=types.SimpleNamespace(Identity=lambda: lambda x: x))
    typing.Bool = typing.Int = _Subscriptable()
    kauldron.typing = typing
    sys.modules.update({"kauldron": kauldron, "kauldron.typing": typing})
    common = types.ModuleType("gemma.gm.typing._common")
    common.Params = dict
    sys.modules["gemma.gm.typing._common"] = common
    from gemma.gm.ckpts import _compat
    from gemma.gm.nn import _layers, _modules

    return _modules, _layers, _compat


class _Subscriptable:
    def __getitem__(self, _):
        return object


def sentencepiece_model() -> bytes:
    """Gemma's ids (pad 0, eos 1, bos 2, unk 3) and turn markers, on the suite's corpus."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import sentencepiece_model

    return sentencepiece_model(
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"]
    )


def build(modules, layers, constants: dict, sizes: dict):
    """The library's Transformer as `gm.nn.Transformer.__call__` composes it, over whole sequences."""
    import flax.linen as nn
    import jax.numpy as jnp

    version = constants["version"]
    pattern = {
        1: [modules.AttentionType.GLOBAL],
        2: [modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL],
        3: [modules.AttentionType.LOCAL_SLIDING] * 5 + [modules.AttentionType.GLOBAL],
    }[version]

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embedder = modules.Embedder(vocab_size=VOCAB, embed_dim=sizes["embed"], name="embedder")
            x = embedder.encode(ids)
            length = ids.shape[1]
            positions = jnp.arange(length)[None]
            mask = jnp.tril(jnp.ones((1, length, length), bool))
            for i in range(sizes["layers"]):
                kind = pattern[i % len(pattern)]
                local = kind == modules.AttentionType.LOCAL_SLIDING
                _, x = modules.Block(
                    name=f"layer_{i}",
                    num_heads=sizes["heads"],
                    num_kv_heads=sizes["kv_heads"],
                    embed_dim=sizes["embed"],
                    head_dim=sizes["head_dim"],
                    hidden_dim=sizes["hidden"],
                    use_post_attn_norm=constants["post_norms"],
                    use_post_ffw_norm=constants["post_norms"],
                    attn_type=kind,
                    query_pre_attn_scalar=sizes["head_dim"] ** -0.5,  # BY_ONE_OVER_SQRT_HEAD_DIM
                    transpose_gating_einsum=constants["transpose"],
                    rope_base_frequency=10_000 if version < 3 or local else 1_000_000,
                    attn_logits_soft_cap=constants["softcap"],
                    sliding_window_size=constants["window"],
                    use_qk_norm=version == 3,
                )(x, positions, None, mask)
            logits = embedder.decode(layers.RMSNorm(name="final_norm")(x))
            if constants["final_softcap"] is not None:
                logits = jnp.tanh(logits / constants["final_softcap"]) * constants["final_softcap"]
            return logits

    return Transformer()


def widths(path, a) -> float:
    return 0.05 if "input_embedding" in jax_path(path) else 0.5 if a.ndim > 1 else 0.3


def jax_path(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def main() -> None:
    import jax
    import orbax.checkpoint as ocp

    jax.config.update("jax_default_matmul_precision", "highest")
    modules, layers, compat = import_library(Path(sys.argv[1]))
    tokenizer = sentencepiece_model()
    for name, (library_class, constants, sizes, layout, prompt) in FAMILIES.items():
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        model = build(modules, layers, constants, sizes)
        rng = np.random.default_rng(len(name))
        ids = rng.integers(4, 400, prompt).tolist()
        params = model.init(jax.random.key(0), np.asarray([ids[:4]]))["params"]
        # the library's initialisers give near-uniform logits (and zero norm scales): widen them so the
        # argmax is decisive and the norms' scales count
        # (the embedding smaller: scaled by √embed, it would outweigh the blocks' normed outputs, and
        # each token would predict itself)
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: rng.normal(0, widths(path, a), a.shape).astype(np.float32), params
        )
        tree = (
            {f"transformer/{k}": v for k, v in compat.flatten_and_remap_params(params).items()}
            if layout == "flat"
            else params
        )
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save((out / "checkpoint").resolve(), tree)
        (out / "tokenizer.model").write_bytes(tokenizer)
        forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
        logits = np.asarray(forward(params, np.asarray([ids]))[0], np.float32)
        greedy = []
        for _ in range(GREEDY):
            # over the tokenizer's ids: the rows past them name no token (jaxinfer never samples them)
            greedy.append(int(np.asarray(forward(params, np.asarray([ids + greedy])))[0, -1, :400].argmax()))
        np.savez_compressed(out / "logits.npz", ids=ids, logits=logits[-16:], greedy=greedy, library=library_class)
        print(name, layout, sorted(p.name for p in out.iterdir()), greedy[:8])


if __name__ == "__main__":
    main()
