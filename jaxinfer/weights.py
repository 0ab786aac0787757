"""The map between Hugging Face tensor names and our parameter tree, and reading safetensors (or a
Flax checkpoint's msgpack) through it.

One table (`weight_table`) drives both directions: loading checks every checkpoint tensor against it
(each mapped exactly once, shape checked), and `abstract_params` builds the restore target for orbax
from it, so the two forms can never disagree about the tree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer import gemma_library, quant
from jaxinfer.config import ModelConfig, leaves_of, stored_methods
from jaxinfer.errors import JaxinferError
from jaxinfer.families import ignored, tensor_name, weight_table
from jaxinfer.forms import Experts, Plain, Quantized, is_matrix, matrix
from jaxinfer.modeldir import CHECKPOINT_FILES
from jaxinfer.sharding import param_shardings, weight_sharding

TreePath = tuple  # ("layers", 3, "wq") or ("embed",)
ProgressFn = Callable[[int, int], None]  # (tensors done, tensors total)


# Buffers some exporters save that are not weights: recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def quantized_here(path: TreePath, shape: tuple[int, ...]) -> bool:
    """Whether `--quantize` packs this leaf (or this expert's slice of it): the embedding, the head
    and the layers' matrices and experts, where their dimensions fit the packing (else they stay float)."""
    return is_matrix(path, shape) and quant.quantizable(shape[-2:])


def tree_from_leaves(cfg: ModelConfig, leaves: dict[TreePath, object]) -> dict:
    tree: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    for path, leaf in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = leaf
    return tree


def abstract_params(
    cfg: ModelConfig, dtype, quantize: str | None = None, mesh: Mesh | None = None, methods: dict | None = None
) -> dict:
    """The parameter tree as ShapeDtypeStructs in their forms: the restore target (no random
    initialisation), each leaf with its place on `mesh` where there is one (orbax reads each device's
    shard only). Matrices are quantized by `quantize` where they fit, or by `methods` where given
    (`forms.methods_of`: a converted GGUF file's, each matrix its own); those the checkpoint holds
    quantized itself (`config.stored_methods`) as it holds them."""
    table = weight_table(cfg)
    stored = stored_methods(table)

    def leaf(path: TreePath, shape: tuple[int, ...]):
        name = ".".join(map(str, path))
        if methods is not None:
            method = methods.get(name)
        else:
            method = stored.get(name) or (quantize if quantize and quantized_here(path, shape) else None)
        if method:
            shapes = quant.METHODS[method].packed_shapes(shape[-2:]).values()
            arrays = [jax.ShapeDtypeStruct(shape[:-2] + s, dtype) for s, dtype in shapes]
            made = Quantized(*arrays[:2], method, *arrays[2:])
        else:
            made = jax.ShapeDtypeStruct(shape, dtype)
            if not is_matrix(path, shape):
                return made
            made = Plain(made)
        return Experts(made) if len(shape) == 3 else made

    tree = tree_from_leaves(cfg, {path: leaf(path, w.shape) for path, w in leaves_of(table).items()})
    if mesh is None:
        return tree
    placed = lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)  # noqa: E731
    return jax.tree.map(placed, tree, param_shardings(cfg, tree, mesh))


def leaf(cfg: ModelConfig, weight, array, dtype, quantize: str | None = None, mesh: Mesh | None = None):
    """One tensor of the checkpoint as its leaf of the tree: on the device (in its shards on `mesh`),
    in `dtype`, a matrix in its form, quantized by `quantize` where it fits the packing (whole on
    every device: the kernel's custom call takes a whole matrix)."""
    path, shape, axes = weight.leaf[:3]
    packs = quantize and quantized_here(path, shape)
    value = jax.device_put(array, weight_sharding(cfg, () if packs else axes, mesh)).astype(dtype)
    return matrix(value, quantize if packs else None) if is_matrix(path, shape) else value


def mxfp4_leaf(weight, blocks: np.ndarray, scales: np.ndarray):
    """An MXFP4 stack of experts from the hub's two tensors (gpt-oss): codes [E, out, in/32, 16], byte j
    of a block holding code 2j (low nibble) and 2j + 1 (high), as transformers unpacks them, and E8M0
    exponents [E, out, in/32]; gate and up de-interleaved where `weight.stored` says "pairs". Each
    expert packed as `quant`'s "mxfp4" (every value the checkpoint's)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    if "pairs" in weight.stored:
        codes, scales = (np.concatenate([a[:, 0::2], a[:, 1::2]], 1) for a in (codes, scales))
    made = [quant.pack(jnp.asarray(c), jnp.asarray(quant.e8m0_scales(s)), "mxfp4") for c, s in zip(codes, scales)]
    return Experts(Quantized(*(jnp.stack(arrays) for arrays in zip(*made)), "mxfp4"))


def read_gguf(
    cfg: ModelConfig,
    file,
    dtype,
    progress: ProgressFn | None = None,
    quantize: str | None = None,
    mesh: Mesh | None = None,
) -> dict:
    """A GGUF file's tensors (`jaxinfer.gguf_model`) through the table into the tree, as
    `read_checkpoint` reads a checkpoint's: its quantized blocks (Q8_0, Q4_0, the k-quants, ...) in
    the `quant` methods of their names, its float matrices quantized only by `quantize`; Llama's q/k
    rows, Gemma's and the Qwen hybrids' norms (and their DeltaNets' A) put back as Hugging Face holds
    them."""
    from jaxinfer import gguf_config, gguf_model

    table = weight_table(cfg)
    names = gguf_model.gguf_names(file, cfg, table)
    read = {part for name in names.values() for part in (name if isinstance(name, tuple) else (name,))}
    extra = gguf_model.unmapped(file, read)
    if extra:
        raise JaxinferError(
            f"{file.path}: tensor {extra[0]} does not belong to a {cfg.architecture} with this metadata"
        )
    leaves = {}
    permuted = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_heads, "bk": cfg.num_kv_heads}
    llama = cfg.architecture in gguf_config.PERMUTED

    def blocks(arrays: tuple, how: str) -> Quantized:
        """A method's arrays, whole on every device (the kernel's custom call takes a whole matrix)."""
        arrays = [None if a is None else jax.device_put(a, weight_sharding(cfg, (), mesh)) for a in arrays]
        packed = quant.pack_k(*arrays, how) if quant.METHODS[how].kind >= 0 else quant.pack(*arrays, how)
        return Quantized(*packed[:2], how, *packed[2:])

    for done, (hf_name, weight) in enumerate(table.items(), 1):
        if weight.expert is not None and weight.expert[0]:
            continue  # the file's one tensor holds the whole stack: read with expert 0
        heads = permuted.get(weight.path[-1]) if llama else None
        shape, name, held = weight.leaf.shape, names[hf_name], is_matrix(weight.path, weight.leaf.shape)
        if isinstance(name, tuple):  # gpt-oss's gate and up: two tensors of the file, one leaf
            how, value = gguf_model.fused_values(file, name, shape, held)
        else:
            how, value = gguf_model.tensor_values(file, name, shape, heads, held=held, order=weight.order)
        # llama.cpp's converter stored Gemma's and Qwen3.5's 1 + weight (not a DeltaNet's gated norm's,
        # which scales by its weight itself)
        norm = len(weight.shape) == 1 and weight.path[-1].endswith("norm") and weight.path[-1] != "gate_norm"
        if cfg.norm_plus_one and norm:
            value = np.asarray(value, np.float32) - 1
        if weight.path[-1] == "a_log":
            value = np.log(-np.asarray(value, np.float32))  # the converter stored -exp(A_log)
        if how == "float":
            leaves[weight.path] = leaf(cfg, weight, value, dtype, quantize, mesh)
        elif isinstance(value, list):  # a stack: each expert's blocks
            experts = [blocks(arrays, how) for arrays in value]
            leaves[weight.path] = Experts(jax.tree.map(lambda *a: jnp.stack(a), *experts))
        else:
            leaves[weight.path] = blocks(value, how)
        if progress:
            progress(done, len(table))
    return tree_from_leaves(cfg, leaves)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json; else a Hugging Face
    Flax checkpoint's flax_model.msgpack (or its index's shards); else a gemma-library checkpoint's
    orbax directory."""
    if checkpoint := gemma_library.checkpoint_of(model_dir):
        return [checkpoint]
    for index, single in CHECKPOINT_FILES:
        if (model_dir / index).is_file():
            try:
                shards = sorted(set(json.loads((model_dir / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as e:
                raise JaxinferError(f"{model_dir / index}: not a valid checkpoint index ({e})") from None
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise JaxinferError(f"{model_dir}: shard {missing[0]} listed in the index is missing")
            return [model_dir / s for s in shards]
        if (model_dir / single).is_file():
            return [model_dir / single]
    raise JaxinferError(
        f"{model_dir}: no model.safetensors (or sharded index) found, nor a Flax flax_model.msgpack; pytorch .bin "
        "checkpoints are not read"
    )


class FlaxTensors:
    """A Hugging Face Flax checkpoint file (`Flax*ForCausalLM.save_pretrained`'s flax_model.msgpack,
    before transformers 5 dropped Flax) with a safetensors handle's `keys` and `get_tensor`: its
    tree restored and flattened by flax itself (`flax.serialization`, `flax.traverse_util`), each
    tensor under the name transformers' own Flax → PyTorch conversion gives it (a `kernel` [in, out]
    transposed into `weight` [out, in]; an `embedding` or `scale` is a `weight`), so the one weight
    table maps it. msgpack is read whole; each tensor is let go once it has been taken (as
    `gemma_library.Tensors`' layers are)."""

    def __init__(self, path: Path):
        from flax import serialization, traverse_util

        try:
            tree = serialization.msgpack_restore(path.read_bytes())
        except Exception as e:  # msgpack's own errors name no common base
            raise JaxinferError(f"cannot read Flax checkpoint {path} ({e}); is it truncated or corrupt?") from None
        self.tensors = {}
        for name, value in traverse_util.flatten_dict(tree, sep=".").items():
            head, _, leaf = name.rpartition(".")
            value = np.asarray(value)
            if leaf == "kernel" and value.ndim == 2:
                name, value = f"{head}.weight", value.T
            elif leaf in ("embedding", "scale"):
                name = f"{head}.weight"
            self.tensors[name] = value

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> np.ndarray:
        return self.tensors.pop(name)


def _tensors(file: Path):
    """A checkpoint file's handle (`keys`, `get_tensor`): a gemma-library checkpoint's orbax directory,
    a Flax msgpack, or safetensors."""
    from safetensors import safe_open

    if file.is_dir():
        return gemma_library.Tensors(file)
    return FlaxTensors(file) if file.suffix == ".msgpack" else safe_open(str(file), framework="np")


def read_checkpoint(
    cfg: ModelConfig,
    files: list[Path],
    dtype,
    progress: ProgressFn | None = None,
    quantize: str | None = None,
    mesh: Mesh | None = None,
) -> dict:
    """Load every tensor of the safetensors (or Flax msgpack) `files` through the table into a tree of
    jax arrays of `dtype`, the matrices as
    `forms.Plain`, or quantized by `quantize` as they are read (peak memory: the quantized model and one float matrix).
    With a `mesh`, each tensor goes from the file straight into its shards (`jaxinfer.sharding`);
    those to be quantized whole onto every device (the kernel's custom call takes a whole matrix)."""
    from safetensors import SafetensorError

    table = weight_table(cfg)
    leaves: dict[TreePath, jax.Array] = {}
    stacks: dict[TreePath, list] = {}  # experts' tensors read so far, by the leaf they stack into
    parts: dict[TreePath, dict] = {}  # an MXFP4 matrix's blocks or scales read so far, by its leaf
    seen: set[str] = set()
    try:
        handles = [_tensors(f) for f in files]
    except (SafetensorError, OSError) as e:
        raise JaxinferError(f"cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    names = [(h, stored) for h in handles for stored in h.keys()]
    for done, (handle, stored) in enumerate(names, 1):
        name = tensor_name(cfg, stored)
        if name in seen:
            raise JaxinferError(f"tensor {name} appears twice in the checkpoint")
        seen.add(name)
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # tied head: the checkpoint repeats the embedding
        if ignored(cfg, name):
            continue
        if name not in table:
            raise JaxinferError(
                f"checkpoint tensor {name} does not belong to a {cfg.architecture} with this config.json"
            )
        weight = table[name]
        path, shape = weight.path, weight.shape
        try:
            array = handle.get_tensor(stored)
        except (SafetensorError, OSError, ValueError) as e:
            raise JaxinferError(f"cannot read tensor {name} ({e}); the file is truncated or corrupt") from None
        if "mxfp4" in weight.stored:  # one of an MXFP4 matrix's two tensors: the leaf when both are read
            if array.dtype != np.uint8 or tuple(array.shape) != shape:
                raise JaxinferError(f"tensor {name} has {array.dtype} {tuple(array.shape)}, MXFP4 needs uint8 {shape}")
            held = parts.setdefault(path, {})
            held[weight.stored.split()[1]] = array
            if len(held) == 2:  # whole on every device, as every quantized matrix (the kernel's call takes it whole)
                placed = weight_sharding(cfg, (), mesh)
                leaves[path] = jax.tree.map(lambda a: jax.device_put(a, placed), mxfp4_leaf(weight, **held))
                del parts[path]
            continue
        if array.dtype.kind in "iub":  # ml_dtypes' bfloat16 is kind "V"
            raise JaxinferError(
                f"tensor {name} holds {array.dtype} values: jaxinfer reads float32, bfloat16 and float16 weights (not "
                "quantized checkpoints)"
            )
        if tuple(array.shape) != shape:
            raise JaxinferError(f"tensor {name} has shape {tuple(array.shape)}, config.json implies {shape}")
        array = weight.arranged(array)
        if weight.expert is not None:  # one expert's slice: the leaf is made when its stack is whole
            e, count = weight.expert
            stack = stacks.setdefault(path, [None] * count)
            stack[e] = array
            if any(a is None for a in stack):
                continue
            array = np.stack(stacks.pop(path))
        leaves[path] = leaf(cfg, weight, array, dtype, quantize, mesh)
        del array
        if progress:
            progress(done, len(names))
    missing = sorted(set(table) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise JaxinferError(f"checkpoint is missing tensor {missing[0]}{more}")
    return tree_from_leaves(cfg, leaves)


def checkpoint_dtype(config_json: dict) -> str | None:
    """The dtype the checkpoint was saved in, as config.json states it (transformers 5 says `dtype`)."""
    return config_json.get("dtype") or config_json.get("torch_dtype")


def dtype_from_name(name: str):
    try:
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
    except KeyError:
        raise JaxinferError(f"unsupported dtype {name!r} (use float32, bfloat16 or float16)") from None
