"""What a weight matrix is held as, and the one place that knows: each form is a registered pytree class
(so jit, device_put, orbax's abstract trees and optax see its arrays), and the matmul, the row gather
and the shard axes dispatch on it (the bytes per value of a method: `quant.METHODS`). Every matrix of
the parameter tree (the layers' `w*`, `embed`, `lm_head`: `is_matrix`) holds one; norms and biases are
plain arrays.

- `Plain` [out, in]: as Hugging Face stores it (`x @ w.T`); what checkpoints hold.
- `Transposed` [in, out]: XLA CPU's faster form for batched decode (`LAYOUTS`' "in_out").
- `Packed`: float32 or bfloat16 with 16 outputs side by side, for the CPU kernel (`jaxinfer.packed`).
- `Quantized`: block-quantized by a method of `quant.METHODS` (static metadata), packed as the CPU
  kernel reads it, or on a GPU in columns as `jaxinfer.gpu`'s kernel reads them (`layout`).
- `Experts`: a mixture's E matrices of one shape in one of the forms above, every array led by the
  experts axis; `expert(e)` is expert e's matrix in that form, which does the products
  (`jaxinfer.layers.feed_forward`).

A loaded tree's matrices are in one layout (`lay_out`): "out_in" (Plain), "in_out" (the layers'
matrices Transposed), "packed", "fused" (a GPU's: "out_in" with the projections that share their
input stacked into one matrix, `FUSED`); Quantized ones stay as they are in each, but on a GPU
(where its kernel runs: `gpu.kernel_here`) the scale-per-block methods' go into columns.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxinfer import gpu, kernel, packed, quant
from jaxinfer.errors import JaxinferError


def _form(cls):
    """A frozen dataclass registered as a pytree: its array fields are children, the rest static."""
    cls = dataclass(frozen=True)(cls)
    names = [f.name for f in cls.__dataclass_fields__.values()]
    static = [name for name in names if cls.__dataclass_fields__[name].metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, [n for n in names if n not in static], static)


def _rounded(x: jax.Array, bf16_inputs: bool) -> jax.Array:
    """x as XLA's dot takes it: rounded to bfloat16 values where the model's products take bfloat16
    inputs (`ModelConfig.matmul_inputs`; the kernel forms round, or quantize, inside)."""
    return packed.bf16_values(x) if bf16_inputs and x.dtype == jnp.float32 else x


@_form
class Plain:
    """[out, in], as Hugging Face stores it."""

    w: jax.Array

    def matmul(self, x: jax.Array, bf16_inputs: bool, dtype) -> jax.Array:
        return jnp.einsum("...i,oi->...o", _rounded(x, bf16_inputs), self.w, preferred_element_type=dtype)

    def take_rows(self, ids: jax.Array, dtype) -> jax.Array:
        return self.w[ids].astype(dtype)

    def dense(self) -> jax.Array:
        return self.w

    def axes(self, axes: tuple, blocks: tuple) -> Plain:
        return Plain(axes)


@_form
class Transposed:
    """[in, out]: XLA CPU's GEMM at 2–32 rows is faster on it (SmolLM-135M shape, decode step at
    B=16: 41 vs 49 ms) while its batch-1 mat-vec is a little slower (17–20 vs 16–17 ms), so batched
    decode on XLA's dot gets this form and batch 1 keeps Hugging Face's."""

    w: jax.Array

    def matmul(self, x: jax.Array, bf16_inputs: bool, dtype) -> jax.Array:
        return jnp.einsum("...i,io->...o", _rounded(x, bf16_inputs), self.w, preferred_element_type=dtype)

    def take_rows(self, ids: jax.Array, dtype) -> jax.Array:
        return jnp.moveaxis(self.w[:, ids], 0, -1).astype(dtype)

    def dense(self) -> jax.Array:
        return self.w.T

    def axes(self, axes: tuple, blocks: tuple) -> Transposed:
        return Transposed(axes[::-1])


@_form
class Packed:
    """16 outputs side by side for the CPU kernel (`jaxinfer.packed`): float32 [out/16, in, 16],
    bfloat16 [out/16, in/2, 16, 2]."""

    w: jax.Array

    @classmethod
    def of(cls, w: jax.Array) -> Packed:
        return cls(packed.pack(w))

    def matmul(self, x: jax.Array, bf16_inputs: bool, dtype) -> jax.Array:
        return packed.matmul(x, self.w, bf16_inputs).astype(dtype)

    def take_rows(self, ids: jax.Array, dtype) -> jax.Array:
        return packed.take_rows(self.w, ids, dtype)

    def dense(self) -> jax.Array:
        return packed.unpack(self.w)

    def axes(self, axes: tuple, blocks: tuple) -> Packed:
        return Packed(())  # whole on every device: the kernel's custom call takes whole matrices


@_form
class Quantized:
    """Block-quantized by `method` (`quant.METHODS`), packed as the CPU kernel reads it; a k-quant's
    float16 scales per super-block in `super_scale`. `layout` "columns": as `jaxinfer.gpu` reads it
    (`gpu.to_columns`)."""

    q: jax.Array
    scale: jax.Array
    method: str = field(metadata={"static": True})
    super_scale: jax.Array | None = None
    layout: str = field(default="packed", metadata={"static": True})

    @classmethod
    def of(cls, w: jax.Array, method: str) -> Quantized:
        return cls(*quant.quantize(w, method), method)

    @property
    def arrays(self) -> tuple:
        return (self.q, self.scale) if self.super_scale is None else (self.q, self.scale, self.super_scale)

    def matmul(self, x: jax.Array, bf16_inputs: bool, dtype) -> jax.Array:
        if self.layout == "columns":
            return gpu.columns_matmul(x, self.arrays, self.method).astype(dtype)
        return quant.matmul(x, self.arrays, self.method).astype(dtype)

    def take_rows(self, ids: jax.Array, dtype) -> jax.Array:
        if self.layout == "columns":
            return gpu.columns_rows(self.arrays, self.method, ids, dtype)
        return quant.take_rows(self.arrays, self.method, ids, dtype)

    def dense(self, dtype=jnp.float32) -> jax.Array:
        if self.layout == "columns":
            return gpu.columns_dense(self.arrays, self.method, dtype).T
        return quant.dequantize(self.arrays, self.method, dtype)

    def in_columns(self) -> Quantized:
        """The same codes and scales as `jaxinfer.gpu` reads them (a scale-per-block method's)."""
        return Quantized(*gpu.to_columns(self.arrays, self.method), self.method, layout="columns")

    def packed(self) -> Quantized:
        """The same codes and scales as checkpoints store them."""
        if self.layout == "packed":
            return self
        return Quantized(*gpu.from_columns(self.arrays, self.method), self.method)

    def axes(self, axes: tuple, blocks: tuple) -> Quantized:
        """`blocks`: the axes of [out/16, in/32] (`sharding.held_axes`), which lead q's and scale's."""
        held = [blocks + (None,) * (len(a.shape) - 2) for a in self.arrays]
        return Quantized(held[0], held[1], self.method, held[2] if len(held) > 2 else None, self.layout)


@_form
class Experts:
    """E matrices of one shape, as one form whose every array is led by the experts axis [E, ...]
    (`inner`: Plain, Packed or Quantized), so loading, quantizing, packing, storing and placing treat
    a mixture's stack as one leaf."""

    inner: Plain | Transposed | Packed | Quantized

    @classmethod
    def of(cls, w: jax.Array, make=Plain) -> Experts:
        """[E, out, in] as E matrices made by `make` ([out, in] → a form), one after another: the
        peak is the stack and one expert's float copy more."""
        if make is Plain:
            return cls(Plain(w))
        made = [make(w[e]) for e in range(w.shape[0])]
        return cls(jax.tree.map(lambda *arrays: jnp.stack(arrays), *made))

    def expert(self, e: jax.Array) -> Plain | Transposed | Packed | Quantized:
        """Expert e's matrix (e traced: a slice of each array, in the inner form)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False), self.inner)

    def on_kernel(self) -> bool:
        """Whether the CPU kernels multiply the stack (packed floats or blocks, the kernels built)."""
        held = isinstance(self.inner, Packed) or (isinstance(self.inner, Quantized) and self.inner.layout == "packed")
        return held and kernel.available()

    def matmul_routed(self, x: jax.Array, experts: jax.Array, bf16_inputs: bool, dtype) -> jax.Array:
        """Rows x [R, in], row r by expert experts[r]'s matrix → [R, out]: one call of the CPU kernels
        (`on_kernel`), which group the rows by expert and read each routed expert once, where it lies."""
        if isinstance(self.inner, Packed):
            return packed.matmul(x, self.inner.w, bf16_inputs, experts=experts).astype(dtype)
        return quant.matmul(x, self.inner.arrays, self.inner.method, experts=experts).astype(dtype)

    def axes(self, axes: tuple, blocks: tuple) -> Experts:
        """Each array's experts axis first (which no mesh splits: `sharding.splits`), then one
        expert's axes as the inner form holds them (packed: whole; quantized: by `blocks`)."""
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.inner)  # an expert's arrays
        inner = one.axes(axes[1:], blocks[1:])
        return Experts(jax.tree.map(lambda a: (axes[0], *a), inner, is_leaf=lambda a: isinstance(a, tuple)))


FORMS = (Plain, Transposed, Packed, Quantized, Experts)
Form = Plain | Transposed | Packed | Quantized | Experts


def is_form(leaf) -> bool:
    return isinstance(leaf, FORMS)


def is_matrix(path: tuple, shape: tuple[int, ...]) -> bool:
    """Whether the tree holds a form at `path` (a weight table's path, a leaf's `shape`): the
    embedding, the head, the layers' `w*` matrices and their experts' stacks (3-D: `Experts`)."""
    named = path[-1] in ("embed", "lm_head") or path[-1].startswith("w")
    return named and (len(shape) == 2 or (len(shape) == 3 and path[-1].startswith("w")))


def matrix(value: jax.Array, quantize: str | None = None) -> Form:
    """A checkpoint's [out, in] matrix (or an [E, out, in] stack of experts) as a form: Plain, or
    quantized by `quantize`."""
    make = Plain if quantize is None else lambda w: Quantized.of(w, quantize)
    return Experts.of(value, make) if value.ndim == 3 else make(value)


def matmul(x: jax.Array, w: Form, bf16_inputs: bool = False, dtype=None) -> jax.Array:
    """x [..., in] @ the matrix's [out, in]ᵀ → [..., out] in `dtype` (default: x's)."""
    return w.matmul(x, bf16_inputs, dtype or x.dtype)


def take_rows(w: Form, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the [out, in] matrix (the embedding lookup): [..., in] in `dtype`."""
    return w.take_rows(ids, dtype)


# ------------------------------------------------------------------------------------------- layouts
LAYOUTS = ("out_in", "in_out", "packed", "fused")

# A layer's matrices that multiply the same input, and the one matrix "fused" stacks them into (its
# outputs one after the other; biases alike): Phi-3's own checkpoints hold them so. On a GPU a decode
# step's small products are each a kernel whose launch and ramp outlast its bytes (the 1B shape's k and
# v projections are 2 MB each, under a microsecond at the bandwidth), so one product each saves three
# kernels a layer and reads the same bytes.
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
FUSE: bool | None = None  # whether the default layout is "fused"; None: on GPUs (tests set it on a CPU)


def layout_for_batch(batch: int, sharded: bool = False) -> str:
    """The layout decode runs fastest in at this batch size: packed for the kernel wherever it takes
    a vectorised path, except over a mesh (`sharded`: the kernel's custom call takes whole matrices,
    XLA's dot takes each device's shard); on a GPU, on one device, "fused"; on XLA's dot, [in, out]
    for batches and [out, in] for one row."""
    if kernel.vectorised() and not sharded:
        return "packed"
    if (FUSE if FUSE is not None else jax.default_backend() == "gpu") and not sharded:
        return "fused"
    return "in_out" if batch > 1 else "out_in"


def check_layout(layout: str | None, sharded: bool = False) -> str:
    """`layout`, or by default the fastest here for one row."""
    layout = layout or layout_for_batch(1, sharded)
    if layout not in LAYOUTS:
        raise JaxinferError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "fused" and sharded:  # a mesh shards q, k and v by their heads, each its own way
        raise JaxinferError("the fused layout is for one device, not a mesh")
    return layout


def stack(parts: list) -> Form | None:
    """The matrices as one, their outputs one after the other, in their form; None where they are
    not of one form (a GGUF file may quantize v by another method than q and k)."""
    first = parts[0]
    if any(type(p) is not type(first) for p in parts):
        return None
    if isinstance(first, Quantized):
        if any((p.method, p.layout) != (first.method, first.layout) for p in parts):
            return None
        axis = 1 if first.layout == "columns" else 0  # columns [in, out]; packed by groups of outputs
        arrays = [jnp.concatenate(a, axis) for a in zip(*(p.arrays for p in parts))]
        return Quantized(arrays[0], arrays[1], first.method, arrays[2] if len(arrays) > 2 else None, first.layout)
    return type(first)(jnp.concatenate([p.w for p in parts], 1 if isinstance(first, Transposed) else 0))


def _fused(layer: dict, consume: bool) -> dict:
    """A layer's projections that share their input stacked (`FUSED`), where it holds them all in one form."""
    layer = dict(layer)
    for name, parts in FUSED.items():
        matrices = [layer.get(f"w{p}") for p in parts]
        biases = [layer.get(f"b{p}") for p in parts]
        if None in matrices or (None in biases and any(b is not None for b in biases)):
            continue
        if (matrix := stack(matrices)) is None:
            continue
        layer[f"w{name}"] = matrix
        if biases[0] is not None:
            layer[f"b{name}"] = jnp.concatenate(biases)
        for p in parts:
            replaced = (layer.pop(f"w{p}"), layer.pop(f"b{p}", None))
            if consume:
                for array in jax.tree.leaves(replaced):
                    array.delete()
    return layer


def lay_out(params: dict, layout: str, consume: bool = False) -> dict:
    """A tree as the checkpoint lays it out ("out_in": Plain) in `layout`; `consume` frees each
    matrix it replaces (peak memory: one layer's matrices more).

    "packed" packs every packable matrix (the layers', the embedding, the LM head) and makes every
    other float leaf (norms, biases, a matrix the packing does not fit) float32: the kernel sums in
    float32 whatever width its weights are stored in (on AMX, prefill's activations carried to 16
    significant bits), so the rest of the model computes in float32 too: bfloat16 weights read half
    the bytes, and the model computes as a float32 one. "in_out" transposes the layers' matrices;
    "fused" stacks each layer's projections of one input (`FUSED`)."""

    def one(value, layer: bool):
        if isinstance(value, Experts):  # packed expert by expert; every other layout takes them as stored
            if not (layout == "packed" and isinstance(value.inner, Plain) and packed.packable(value.inner.w[0])):
                return value
            replacement = Experts.of(value.inner.w, Packed.of)
        elif isinstance(value, Quantized) and columns and _whole(value) and _in_columns(value.method):
            if value.layout == "columns":
                return value
            replacement = value.in_columns()
        elif layout == "packed" and isinstance(value, Plain) and packed.packable(value.w):
            replacement = Packed.of(value.w)
        elif layout == "packed" and not isinstance(value, Quantized):
            array = value.w if isinstance(value, Plain) else value
            if array.dtype == jnp.float32 or not jnp.issubdtype(array.dtype, jnp.floating):
                return value
            replacement = Plain(array.astype(jnp.float32)) if isinstance(value, Plain) else array.astype(jnp.float32)
        elif layout == "in_out" and layer and isinstance(value, Plain):
            replacement = Transposed(jnp.asarray(value.w.T))
        else:
            return value
        if consume:
            for array in jax.tree.leaves(value):
                array.delete()
        return replacement

    columns = gpu.kernel_here()
    if layout == "out_in" and not columns:
        return params
    tree = {key: one(value, False) for key, value in params.items() if key != "layers"}
    tree["layers"] = [{key: one(value, True) for key, value in layer.items()} for layer in params["layers"]]
    if layout == "fused":
        tree["layers"] = [_fused(layer, consume) for layer in tree["layers"]]
    return tree


def _in_columns(method: str) -> bool:
    """Whether the GPU's kernel reads this method's blocks (`jaxinfer.gpu`: the scale-per-block ones
    whose 4-bit codes are q + 8; MXFP4's are dequantized in the graph there)."""
    m = quant.METHODS[method]
    return m.kind < 0 and not m.e2m1


def _whole(leaf: Quantized) -> bool:
    """Whether the matrix is held whole on one device (a mesh's shards stay packed: XLA's product)."""
    sharding = getattr(leaf.q, "sharding", None)
    return sharding is None or len(sharding.device_set) == 1


def layout_of(params: dict) -> str:
    """The layout a tree's layers are in (`LAYOUTS`), as `lay_out` left them."""
    layer = params["layers"][0]
    if any(isinstance(leaf, Packed) for leaf in layer.values()):
        return "packed"
    if any(isinstance(leaf, Transposed) for leaf in layer.values()):
        return "in_out"
    return "fused" if any(f"w{name}" in layer for name in FUSED) else "out_in"


def quantized_by(params: dict) -> str | None:
    """The method the tree's matrices are quantized by, if any."""
    leaves = (*params["layers"][0].values(), params["embed"])
    return next((leaf.method for leaf in leaves if isinstance(leaf, Quantized)), None)


def stored_dtype(params: dict):
    """The dtype the float matrices are stored in (the final norm's where every matrix is quantized)."""
    leaves = (*params["layers"][0].values(), params["embed"])
    return next(
        (leaf.w.dtype for leaf in leaves if isinstance(leaf, (Plain, Transposed, Packed))), params["norm"].dtype
    )


def methods_of(params: dict) -> dict[str, str]:
    """Each quantized matrix's method by its path ("layers.3.wq", "embed"): what a converted GGUF
    file's config.json records, its matrices being of several methods."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_form)[0]
    name = lambda path: ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)  # noqa: E731
    inner = lambda leaf: leaf.inner if isinstance(leaf, Experts) else leaf  # noqa: E731
    return {name(path): inner(leaf).method for path, leaf in flat if isinstance(inner(leaf), Quantized)}


def methods_named(methods: dict[str, str]) -> str | None:
    """Matrices' methods by path (`methods_of`) as one name, the most common first: "q8_0",
    "q4_k/q6_k" (a GGUF file's mix); None where none is quantized."""
    return "/".join(method for method, _ in Counter(methods.values()).most_common()) or None


def on_kernel(params: dict) -> bool:
    """Whether the tree holds matrices in the CPU kernels' forms."""
    return any(isinstance(leaf, (Packed, Quantized)) for leaf in params["layers"][0].values())


# ------------------------------------------------------------------------------ the stored form
def to_stored(params: dict) -> dict:
    """The tree as checkpoints hold it (orbax, as converted by every version so far): a Plain matrix
    as its array, a Quantized one as {"q", "scale"} and a k-quant's "super_scale" (its method in
    config.json). The leaves come in the same order as the forms', so `jax.tree.unflatten` with a forms
    tree's structure undoes it."""

    def one(leaf):
        if isinstance(leaf, Experts):
            return one(leaf.inner)
        if isinstance(leaf, Quantized):
            return dict(zip(("q", "scale", "super_scale"), leaf.packed().arrays))
        if isinstance(leaf, Plain):
            return leaf.w
        if is_form(leaf):
            raise ValueError(f"only Plain and Quantized matrices are stored, not {type(leaf).__name__}")
        return leaf

    return jax.tree.map(one, params, is_leaf=is_form)
