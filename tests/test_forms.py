"""The weight forms (`jaxinfer.forms`): each one's product and row lookup against its dense matrix, the
stored form, checkpoints converted before the forms existed, and a mixture's stacks through the routed
product against a dense reference, in every form, on every kernel path."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import forms, kernel, model
from jaxinfer.checkpoint import restore_params, save_params
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.forms import Experts, Packed, Plain, Quantized, Transposed
from jaxinfer.layers import feed_forward
from jaxinfer.loading import load_model
from jaxinfer.modeldir import ORBAX_DIR
from jaxinfer.weights import abstract_params

DATA = Path(__file__).parent / "data"


def every_form(w: jax.Array) -> list:
    return [
        Plain(w),
        Transposed(w.T),
        Packed.of(w),
        Packed.of(w.astype(jnp.bfloat16)),
        Quantized.of(w, "int8"),
        Quantized.of(w, "int4"),
    ]


@pytest.mark.parametrize("kind", ["plain", "transposed", "packed", "packed-bf16", "int8", "int4"])
def test_each_form_multiplies_and_looks_up_rows_as_its_dense_matrix(kind):
    """Within float32 rounding of x @ dense.T (int8/int4 on the kernel quantize x per block of 32 too:
    each activation within half its block's step, under 1% of Σ|x·w|), on rows with leading axes;
    the rows of ids exactly."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
    form = every_form(w)[["plain", "transposed", "packed", "packed-bf16", "int8", "int4"].index(kind)]
    dense = np.asarray(form.dense(), np.float64)
    assert dense.shape == (48, 64)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    ours = np.asarray(jax.jit(forms.matmul)(x, form))
    exact = np.asarray(x, np.float64) @ dense.T
    magnitude = np.abs(np.asarray(x, np.float64)) @ np.abs(dense).T
    share = 0.01 if kind in ("int8", "int4") else 64 * np.finfo(np.float32).eps
    assert ours.shape == (2, 3, 48) and ours.dtype == np.float32
    np.testing.assert_array_less(np.abs(ours - exact), share * magnitude + 1e-6)
    ids = jnp.asarray([[0, 17, 47], [5, 5, 32]])
    np.testing.assert_array_equal(forms.take_rows(form, ids, jnp.float32), dense[np.asarray(ids)].astype(np.float32))


def test_the_stored_form_round_trips_through_orbax(tmp_path):
    """A tree of Plain and Quantized matrices saves as arrays and {"q", "scale"} and comes back as the
    same forms, bit for bit."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal((32, 64)), jnp.float32)
    tree = {"embed": Plain(w), "layers": [{"wq": Quantized.of(w, "int4"), "attn_norm": jnp.ones(64)}], "norm": w[0]}
    stored = forms.to_stored(tree)
    assert set(stored["layers"][0]["wq"]) == {"q", "scale"} and isinstance(stored["embed"], jax.Array)
    save_params(tree, tmp_path / "params")
    back = restore_params(tmp_path / "params", jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree))
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="Packed"):
        forms.to_stored({"embed": Packed.of(w)})


@pytest.mark.parametrize("method", ["float32", "int8", "int4"])
def test_checkpoints_converted_before_the_forms_still_load(tmp_path, method):
    """tests/data/converted-*: a tiny random llama converted by `jaxinfer convert --dtype float32
    [--quantize M]` on d257d5e (dict-shaped matrices, the method guessed from q's dtype), with the
    logits that version computed for a prompt (AMD EPYC, XLA and the AVX-512 kernels). Today's load
    gives the same logits in every layout, and saves the same tree again."""
    path = tmp_path / method
    shutil.copytree(DATA / f"converted-{method}", path)
    tokens = jnp.asarray(np.load(DATA / f"converted-{method}.tokens.npy"))
    expected = np.load(DATA / f"converted-{method}.logits.npy")
    positions = jnp.arange(tokens.shape[1])[None]
    for layout in forms.LAYOUTS:
        loaded = load_model(path, "float32", layout=layout)
        assert loaded.quantize == (None if method == "float32" else method)
        assert forms.quantized_by(loaded.params) == loaded.quantize
        hidden, _ = model.forward(loaded.params, loaded.config, tokens, positions, None, tokens.shape[1])
        np.testing.assert_allclose(model.logits(loaded.params, hidden, loaded.config), expected, rtol=1e-4, atol=1e-4)
    stored = load_model(path, "float32", layout="out_in")
    save_params(stored.params, tmp_path / "again")
    abstract = abstract_params(stored.config, jnp.float32, stored.quantize)
    before = restore_params(path / ORBAX_DIR, abstract)
    for a, b in zip(jax.tree.leaves(restore_params(tmp_path / "again", abstract)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert json.loads((path / "config.json").read_text()).get("jaxinfer_quantize") == stored.quantize


@pytest.mark.parametrize("kind", ["plain", "transposed", "packed", "packed-bf16", "int8", "int4"])
def test_matrices_stacked_multiply_as_each_one_does(kind):
    """`forms.stack`: one product over the stacked outputs equals the parts' products side by side, in
    every form (columns: tests/test_gpu.py's model test)."""
    rng = np.random.default_rng(2)
    parts = [jnp.asarray(rng.standard_normal((n, 64)), jnp.float32) for n in (64, 32, 32)]
    index = ["plain", "transposed", "packed", "packed-bf16", "int8", "int4"].index(kind)
    held = [every_form(w)[index] for w in parts]
    stacked = forms.stack(held)
    assert type(stacked) is type(held[0])
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(forms.matmul(x, stacked)),
        np.concatenate([np.asarray(forms.matmul(x, m)) for m in held], -1),
        rtol=1e-5,
        atol=1e-5,
    )
    # forms or methods that differ are left apart
    assert forms.stack([held[0], Plain(parts[1]) if kind != "plain" else Quantized.of(parts[1], "int8")]) is None
    if kind == "int8":
        assert forms.stack([held[0], Quantized.of(parts[1], "int4")]) is None


@pytest.mark.parametrize("arch, quantize", [("llama", None), ("qwen2", None), ("llama", "int4"), ("phi3", None)])
def test_the_fused_layout_computes_what_the_checkpoints_layout_does(tiny, arch, quantize):
    """A GPU's default layout: each layer's q/k/v and gate/up one matrix (Qwen2's biases too; Phi-3's
    are already), the same logits as the checkpoint's layout within float32 rounding."""
    path = tiny(arch)
    plain = load_model(path, layout="out_in", quantize=quantize, dtype="float32")
    fused = load_model(path, layout="fused", quantize=quantize, dtype="float32")
    layer = fused.params["layers"][0]
    assert {"wqkv", "wgate_up"} <= set(layer) and not {"wq", "wk", "wv", "wgate", "wup"} & set(layer)
    assert ("bqkv" in layer) == (arch == "qwen2") and forms.layout_of(fused.params) == "fused"
    tokens = jnp.asarray([[0, 11, 42, 7, 19, 3]])
    positions = jnp.arange(6)[None]
    outputs = [
        model.logits(m.params, model.forward(m.params, m.config, tokens, positions, None, 6)[0], m.config)
        for m in (plain, fused)
    ]
    np.testing.assert_allclose(np.asarray(outputs[1]), np.asarray(outputs[0]), rtol=1e-5, atol=1e-5)


def test_the_fused_layout_is_for_one_device(monkeypatch):
    with pytest.raises(JaxinferError, match="one device"):
        forms.check_layout("fused", sharded=True)
    monkeypatch.setattr(forms, "FUSE", True)  # as on a GPU, where the CPU kernels are not used
    monkeypatch.setattr(kernel, "enabled", False)
    assert forms.layout_for_batch(1) == forms.layout_for_batch(16) == "fused"
    assert forms.layout_for_batch(16, sharded=True) == "in_out"


# A mixture's stacks (`forms.Experts`) through the routed MLP (`jaxinfer.layers.feed_forward`).
E, D, F = 5, 64, 32
CFG = ModelConfig("test", 16, D, 0, 1, 1, 1, D, 1e-5, 64, 1e4, num_experts=E, experts_per_token=2, expert_size=F)
MAKERS = {
    "plain": None,
    "packed": Packed.of,
    "packed-bf16": lambda w: Packed.of(w.astype(jnp.bfloat16)),
    "int8": lambda w: Quantized.of(w, "int8"),
    "q4_0": lambda w: Quantized.of(w, "q4_0"),
}


def stacks(kind: str) -> dict:
    rng = np.random.default_rng(0)
    layer = {}
    for name, shape in (("we_gate", (E, F, D)), ("we_up", (E, F, D)), ("we_down", (E, D, F))):
        w = jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)
        layer[name] = Experts(forms.Plain(w)) if MAKERS[kind] is None else Experts.of(w, MAKERS[kind])
    return layer


def dense_reference(layer: dict, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_k weights · expert MLP, in float64 over each expert's dense matrix, and Σ|terms| for a bound."""
    dense = lambda name, e: np.asarray(layer[name].expert(jnp.int32(e)).dense(), np.float64)  # noqa: E731
    matrices = {name: [dense(name, e) for e in range(E)] for name in layer}
    out, magnitude = np.zeros((len(x), D)), np.zeros((len(x), D))
    for n, row in enumerate(x.astype(np.float64)):
        for e, w in zip(ids[n], weights[n]):
            gate, up = matrices["we_gate"][e] @ row, matrices["we_up"][e] @ row
            h = gate / (1 + np.exp(-gate)) * up
            out[n] += w * (matrices["we_down"][e] @ h)
            magnitude[n] += abs(w) * (np.abs(matrices["we_down"][e]) @ np.abs(h))
    return out, magnitude


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("rows", [1, 6, 40])  # the pairs plan (2 pairs), the tiles plan (12, 80 pairs)
def test_the_routed_product_is_the_dense_mixture(kind, rows, isa):
    """Every row through its two experts, weighted: random choices, every row on one expert (a tile
    of that expert only, the others skipped), and choices that leave experts unpicked; in every form,
    on each kernel path. Float forms to float32 rounding; the quantized ones within 6% of Σ|terms|
    (a wrong expert or weight misses by about 100%): the kernel quantizes each product's activations
    per block (1% a product: the forms' test above), and the down product's inputs carry the gate and up
    products' error through the activation (3.4% seen at one of 2,560 outputs)."""
    layer = stacks(kind)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, D)).astype(np.float32)
    weights = rng.uniform(0.1, 1, (rows, 2)).astype(np.float32)
    routed = jax.jit(feed_forward.routed_mlp, static_argnums=4)
    for ids in (
        rng.integers(0, E, (rows, 2)),
        np.stack([np.full(rows, 3), np.full(rows, 1)], 1),
        np.stack([np.zeros(rows, int), np.full(rows, E - 1)], 1),
    ):
        ours = np.asarray(routed(layer, jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(weights), CFG))
        exact, magnitude = dense_reference(layer, x, ids, weights)
        share = 0.06 if kind in ("int8", "q4_0") else 1e-5
        np.testing.assert_array_less(np.abs(ours - exact), share * magnitude + 1e-5)
