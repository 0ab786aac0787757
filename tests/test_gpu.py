"""The GPU's kernels on the CPU, through Pallas' interpreter (`gpu.MODE = "interpret"`): what a GPU
runs, checked where CI runs. Quantized matrices in columns (`gpu.to_columns`) hold the packed
form's codes and scales exactly; the kernel's products equal the dequantized matrix's within float32
rounding, for decode's rows; a model quantized in columns generates what the packed form does
through XLA's product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import forms, gpu, kernel
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setattr(gpu, "MODE", "interpret")


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0", "q4_0"])
def test_columns_hold_the_packed_matrix_and_the_kernel_multiplies_it(interpret, method):
    for out, in_, rows in ((256, 512, 1), (160, 64, 16), (48, 96, 5), (128, 256, 40)):
        w = jax.random.normal(jax.random.key(out + in_), (out, in_)) * 0.02
        packed = forms.Quantized.of(w, method)
        columns = packed.in_columns()
        assert columns.layout == "columns" and columns.q.shape == (in_ // (2 if "4" in method else 1), out)
        assert all(bool((a == b).all()) for a, b in zip(packed.arrays, columns.packed().arrays))
        dense = np.asarray(packed.dense())
        np.testing.assert_array_equal(np.asarray(columns.dense()), dense)
        ids = jnp.asarray([[0, 7], [out - 1, 3]])
        np.testing.assert_array_equal(np.asarray(columns.take_rows(ids, jnp.float32)), dense[np.asarray(ids)])
        x = jax.random.normal(jax.random.key(rows), (rows, in_)).astype(jnp.bfloat16)
        expected = np.asarray(x, np.float32) @ dense.T
        got = np.asarray(columns.matmul(x, False, jnp.float32))
        # the kernel (≤ 16 rows): float32 sums of exact products; more rows: the matrix in bfloat16
        bound = 1e-6 if rows <= gpu.ROWS else 4e-3
        assert np.abs(got - expected).max() <= bound * np.abs(expected).max(), (rows, method)


def test_the_inputs_split_until_the_programs_fill_the_gpu():
    assert gpu.split(4096 // 32, 14336 // 128) == 4  # 8B gate/up: 112 programs × 4 shares
    assert gpu.split(14336 // 32, 4096 // 128) == 16  # 8B down: 32 × 16 (256 would not fill them)
    assert gpu.split(3, 1) == 1  # blocks that do not halve stay whole


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
@pytest.mark.parametrize("quantize", ["int4"])  # int8's columns: the matrices' test; 4 bits unpack more
def test_a_model_in_columns_generates_what_the_packed_form_does(tiny, monkeypatch, quantize):
    path = tiny("llama")
    ids = [0, 11, 42, 7, 19, 3]

    def greedy(model) -> list[int]:
        gen = Generation(model, Engine(model.config, model.params, 64, ()), ids, Sampling(), 12)
        list(gen)
        return gen.token_ids

    monkeypatch.setattr(kernel, "enabled", False)  # the packed form through XLA's product, as a GPU had it
    expected = greedy(load_model(path, quantize=quantize))
    monkeypatch.setattr(gpu, "MODE", "interpret")
    model = load_model(path, quantize=quantize, layout="fused")  # a GPU's: q/k/v, gate/up stacked in columns
    assert {
        leaf.layout
        for leaf in jax.tree.leaves(model.params, is_leaf=forms.is_form)
        if isinstance(leaf, forms.Quantized)
    } == {"columns"}
    assert "wqkv" in model.params["layers"][0]
    assert greedy(model) == expected
    stored = forms.to_stored(model.params)  # checkpoints keep the packed form
    assert stored["layers"][0]["wqkv"]["q"].ndim == 5


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the kernel lowers")
def test_a_kernel_that_cannot_run_here_turns_itself_off():
    """Tried once (`gpu._works`): where it does not lower (here: no Triton on the CPU) or answers
    wrong, matrices stay packed and XLA multiplies them."""
    gpu._works.cache_clear()
    assert not gpu._works() and not gpu.kernel_here()
    tree = {"layers": [{"wq": forms.Quantized.of(jnp.ones((32, 64)), "int8")}], "embed": forms.Plain(jnp.ones((16, 8)))}
    assert forms.lay_out(tree, "in_out")["layers"][0]["wq"].layout == "packed"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the kernel itself, lowered by Triton: on a GPU")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_a_gpu_the_kernel_lowers_and_multiplies(method):
    assert gpu.kernel_here()
    for out, in_, rows in ((4096, 4096, 1), (2048, 8192, 16), (14336, 4096, 4)):
        w = jax.random.normal(jax.random.key(out), (out, in_)) * 0.02
        columns = forms.Quantized.of(w, method).in_columns()
        x = jax.random.normal(jax.random.key(rows), (rows, in_)).astype(jnp.bfloat16)
        expected = np.asarray(jnp.dot(x.astype(jnp.float32), columns.dense().T, precision="highest"))
        got = np.asarray(columns.matmul(x, False, jnp.float32))
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max(), (out, in_, rows)


def test_the_kernel_check_answers_where_it_is_first_asked_while_tracing(interpret):
    """On a GPU the first question may come from `lay_out` under `eval_shape` (compile-ahead's
    abstract weights): the check still runs the kernel, not a trace of it that would say no."""
    answers = []
    jax.eval_shape(lambda: answers.append(gpu._works.__wrapped__()) or jnp.zeros(()))
    assert answers == [True]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "tiles",
    [
        None,
        gpu.Tiles(),
        gpu.Tiles(step=4, bn=256, unpack="i8", pad=False, evict=True),
        gpu.Tiles(kind="fma", step=8, unpack="magic"),
    ],
    ids=["chosen", "dot", "dot-fat", "fma"],
)
def test_the_kernel_lowers_to_triton_at_the_8b_shapes(bits, tiles):
    """What JAX hands XLA's GPU backend for the Llama-3.1-8B shape's matrices (the down projection's
    shares are 896 inputs, not a power of two): a Triton call each, for the chosen tiles (`gpu.TILES`)
    and the sweep's other kinds. JAX lowers for CUDA on any machine; the compilation to the GPU's code is checked
    there (`gpu._works`)."""
    tiles = tiles or gpu.TILES[bits]
    for K, N in ((4096, 6144), (4096, 28672), (14336, 4096), (4096, 128256)):
        args = (
            jnp.zeros((1 if tiles.kind == "fma" or not tiles.pad else gpu.ROWS, K), jnp.bfloat16),
            jnp.zeros((K // (8 // bits), N), jnp.int8 if bits == 8 else jnp.uint8),
            jnp.zeros((K // 32, N), jnp.bfloat16),
        )
        lowered = (
            jax.jit(lambda *a: gpu._quantized_matmul(*a, bits, False, tiles))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
        )
        assert "xla.gpu.triton" in lowered.as_text(), (K, N)
