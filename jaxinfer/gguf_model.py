"""A GGUF file (llama.cpp, ollama, LM Studio) as a model: its metadata as the config.json it stands for
(`jaxinfer.gguf_config`), its tokenizer (`Tokenizer.from_gguf`), and its tensors read through the
family's weight table.

The file is read with the `gguf` package (llama.cpp's own reader), memory-mapped: each tensor is
copied once, as it goes to the device. Names: the weight table's Hugging Face names, turned into
GGUF's by the package's own name map, so every tensor of the file is mapped exactly once, with its
shape checked. What llama.cpp's converter changed is undone: Llama's q and k rows, permuted for its
rope (`_unpermute`); a Llama 3 rope scaling, stored as per-frequency factors (the `rope_freqs`
tensor, `ModelConfig`'s "freq_factors"); Gemma's norms, stored as 1 + weight (`weights.read_gguf`).
What the file leaves out is read as llama.cpp reads it (`jaxinfer.gguf_config`).

Tensor types: F32, F16 and BF16 are float matrices; a type named as a `quant.METHODS` entry (Q8_0,
Q4_0, Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, MXFP4) is held in that method, the file's blocks repacked as the
kernels read them with every value unchanged (`_scale_and_min` unpacks the k-quants' 6-bit scales);
Q2_K and Q3_K (`DEQUANTIZED`) are dequantized to float32 as they load — the same values, without
their bandwidth saving.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxinfer.errors import JaxinferError

MAGIC = b"GGUF"

FILE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # the float types
DEQUANTIZED = ("Q2_K", "Q3_K")  # no kernel of ours reads them: float32 as they load


def method_of(kind: str) -> str | None:
    """The `quant.METHODS` entry a tensor type is held in as it is (a GGUF type of the same name)."""
    from jaxinfer.quant import METHODS

    return kind.lower() if kind.lower() in METHODS and kind.startswith(("Q", "MXFP4")) else None


def read_types() -> list[str]:
    from jaxinfer.quant import METHODS

    return [*FILE_DTYPES, *(m.upper() for m in METHODS if method_of(m.upper())), *DEQUANTIZED]


def is_gguf(path: Path) -> bool:
    """A file named .gguf, or any file that begins with GGUF's magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    meta: dict  # every key → its value (strings, numbers, lists)
    tensors: dict  # name → gguf.ReaderTensor (its data a view of the memory-mapped file)

    @property
    def architecture(self) -> str:
        return self.meta["general.architecture"]


def open_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensors, checked as far as reading them goes (one line on failure)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: Path, size: int, mtime: int) -> GGUFFile:
    import gguf

    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != MAGIC:
        raise JaxinferError(f"{path}: not a GGUF file (it begins {head[:4]!r}, not {MAGIC!r})")
    version = int.from_bytes(head[4:8], "little")
    if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
        raise JaxinferError(
            f"{path}: GGUF version {version} is not one jaxinfer reads "
            f"(it reads {', '.join(map(str, gguf.gguf_reader.READER_SUPPORTED_VERSIONS))})"
        )
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, OSError) as e:
        if isinstance(e, ValueError) and "reshape" in str(e):  # the reader's view of a tensor cut by the file's end
            raise JaxinferError(f"{path}: the file is truncated: a tensor's data runs past its end ({size:,} bytes)")
        raise JaxinferError(
            f"{path}: the GGUF header cannot be read, is the file truncated or corrupt? ({e})"
        ) from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise JaxinferError(f"{path}: the file is truncated: its tensors need {end} bytes and it has {size}")
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if "general.architecture" not in meta:
        raise JaxinferError(f"{path}: the GGUF file names no general.architecture")
    return GGUFFile(path, meta, {t.name: t for t in reader.tensors})


def quantized_by(file: GGUFFile) -> str | None:
    """The method (`quant.METHODS`) most of the layers' matrices are held in as the file stores them."""
    methods = [method_of(k) for k in layer_types(file) if method_of(k)]
    return max(set(methods), key=methods.count) if methods else None


def layer_types(file: GGUFFile) -> list[str]:
    return [t.tensor_type.name for name, t in file.tensors.items() if len(t.shape) == 2 and name.startswith("blk.")]


def tensor_named(file: GGUFFile, name: str):
    """The file's tensor `name`; "name#j": matrix j of a stacked tensor (`gguf_names`' for a leaf
    the file holds in a stack: Gemma 3n's AltUp projections)."""
    name, _, part = name.partition("#")
    if name not in file.tensors:
        raise JaxinferError(f"{file.path}: the GGUF file has no tensor {name}")
    return _Slice(file.tensors[name], int(part)) if part else file.tensors[name]


def gguf_names(file: GGUFFile, cfg, table: dict) -> dict[str, str | tuple[str, str]]:
    """The weight table's Hugging Face names → the GGUF file's (the `gguf` package's name map for the
    file's architecture); every expert's tensor of a stack → the file's one merged tensor
    (`ffn_gate_exps`, ...); gpt-oss's gate and up, fused in its checkpoints, → the two the converter
    splits them into (gate's, up's); Gemma 3n's AltUp projections, a leaf each here, → their matrix
    of the one stack the converter makes ("altup_proj.weight#j", `tensor_named`)."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == file.architecture)
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)

    def merged(hf: str) -> str:
        expert = table[hf].expert
        if hf.endswith(".linear_attn.dt_bias"):  # the converter's name for it (its `dt_proj`)
            return hf.replace(".dt_bias", ".dt_proj.bias")
        if hf.endswith(
            ("_proj_bias", ".experts.down_proj", ".experts.gate_up_proj", ".sinks", ".layer_scalar", "_output_scale")
        ):
            return hf[: -len("_bias")] + ".bias" if hf.endswith("_bias") else hf + ".weight"  # gpt-oss's, Gemma 4's
        return hf if expert is None else hf.replace(f".experts.{expert[0]}.", ".experts.")

    def name(hf: str) -> str | tuple[str, str]:
        # Gemma 4's router scales: as its converter names them, beside the router's and the down stack's
        for scale, beside in ((".router.scale", ".router.proj"), (".router.per_expert_scale", ".experts.down_proj")):
            if hf.endswith(scale):
                return names.get_name(hf[: -len(scale)] + beside) + ".scale"
        if stacked := re.fullmatch(r"(model\.altup_(?:unembed_)?projections)\.(\d+)\.weight", hf):
            return f"{names.get_name(stacked[1] + '.weight', try_suffixes=('.weight',))}#{stacked[2]}"
        if ".experts.gate_up_proj" in hf and file.architecture == "gpt-oss":  # gate and up: one tensor here, two there
            stack, suffix = hf.split(".experts.")[0] + ".experts.", ".bias" if hf.endswith("_bias") else ".weight"
            return tuple(
                names.get_name(f"{stack}{part}{suffix}", try_suffixes=(suffix,)) for part in ("gate_proj", "up_proj")
            )
        return names.get_name(merged(hf), try_suffixes=(".weight", ".bias"))

    return {hf: name(hf) for hf in table}


def held_method(kind: str, shape: tuple[int, ...], held: bool = True) -> str | None:
    """The method a tensor of type `kind` is held in as the file stores it, or None (read as floats): a
    matrix or stack the kernels multiply (`held`), of a type named as a method, in whole groups of 16."""
    how = method_of(kind) if held else None
    return how if how and len(shape) in (2, 3) and shape[-2] % 16 == 0 else None


def methods_by_path(file: GGUFFile, cfg) -> dict[str, str]:
    """Each matrix the file holds quantized, by its path in our tree ("layers.3.wq"): its method, as
    `weights.read_gguf` will hold it (what `info` counts before loading; a converted file's
    config.json records the same)."""
    from jaxinfer.families import weight_table
    from jaxinfer.forms import is_matrix

    table = weight_table(cfg)
    methods = {}
    for hf, name in gguf_names(file, cfg, table).items():
        leaf = table[hf].leaf
        kind = tensor_named(file, name[0] if isinstance(name, tuple) else name).tensor_type.name
        if how := held_method(kind, leaf.shape, is_matrix(leaf.path, leaf.shape)):
            methods[".".join(map(str, leaf.path))] = how
    return methods


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's permutation of Llama's q/k rows (its `LlamaModel.permute`: each
    head's two halves interleaved for its rope) on [rows, ...] (float values or quantized blocks)."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def tensor_values(
    file: GGUFFile,
    name: str,
    shape: tuple[int, ...],
    heads: int | None = None,
    expert: int | None = None,
    held=True,
    order: tuple[int, ...] | None = None,
):
    """One tensor as (kind, value): ("float", array), or (method, arrays) for the blocks a method holds
    as they are: `quant.pack`'s (codes [n, k/32, 32], scales [n, k/32]), or `quant.pack_k`'s
    (`_scale_and_min`); of a stack of experts [E, out, in] (method, [each expert's arrays]). `heads`:
    undo the q/k permutation over that many heads; `expert`: that expert's matrix of the stack;
    `held` False: floats whatever the type (a leaf no kernel multiplies: a router); `order`: its rows
    in this order (`config.Weight.order`)."""
    import gguf

    tensor = tensor_named(file, name)
    if expert is not None:
        tensor = _Slice(tensor, expert)
    kind = tensor.tensor_type.name
    stored = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if stored == tuple(n for n in shape if n != 1):  # the converter squeezes [1, D] (Qwen2-MoE's shared gate)
        stored = shape
    if stored != shape:
        raise JaxinferError(f"{file.path}: tensor {name} has shape {stored}, the metadata implies {shape}")
    if kind not in read_types():
        raise JaxinferError(
            f"{file.path}: tensor {name} is {kind}, a type jaxinfer does not read (it reads {', '.join(read_types())})"
        )
    raw = tensor.data
    if heads:
        raw = _unpermute(raw, heads)
    if order is not None:
        raw = raw[np.asarray(order)]
    how = held_method(kind, shape, held)
    if how:
        from jaxinfer.quant import METHODS

        if len(shape) == 3:  # a stack of experts: each one's blocks, as a 2-D matrix's, one after another
            return how, [tensor_values(file, name, shape[1:], None, e)[1] for e in range(shape[0])]
        blocks = np.asarray(raw).reshape(shape[0], shape[1] // METHODS[how].block, -1)
        if METHODS[how].kind >= 0:
            return how, _scale_and_min(blocks, how)
        return how, block_arrays(blocks, how)
    if kind == "BF16":
        import ml_dtypes

        return "float", np.asarray(raw).view(np.uint16).view(ml_dtypes.bfloat16).reshape(shape)
    if kind in FILE_DTYPES:
        return "float", np.asarray(raw).reshape(shape)  # the shape the converter squeezed, put back
    return "float", gguf.quants.dequantize(np.asarray(raw), tensor.tensor_type).reshape(shape)


def block_arrays(blocks: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """A scale-per-block type's blocks [n, k/32, bytes] → `quant.pack`'s (codes [n, k/32, 32], scales
    [n, k/32]): Q8_0's and Q4_0's a float16 scale, then the codes; MXFP4's an E8M0 exponent, then
    the codes (`quant.e8m0_scales`). In 4-bit blocks byte j holds code j (low nibble) and j + 16 (high)."""
    from jaxinfer.quant import e8m0_scales

    if how == "mxfp4":
        scales, packed = e8m0_scales(blocks[..., 0]), blocks[..., 1:]
    else:
        scales, packed = blocks[..., :2].copy().view(np.float16)[..., 0], blocks[..., 2:]
    if how == "q8_0":
        return packed.view(np.int8), scales
    return np.concatenate([packed & 0x0F, packed >> 4], -1), scales


def fused_values(file: GGUFFile, names: tuple[str, str], shape: tuple[int, ...], held: bool = True):
    """gpt-oss's gate and up, two tensors of the file (`gguf_names`), as its checkpoints' one: gate's
    outputs, then up's (a stack [E, 2F, D]; `held` False: a bias [E, 2F]), as `tensor_values` gives
    each. The two must share a type (llama.cpp's quantizer gives them one)."""
    axis = len(shape) - 2 if held else len(shape) - 1
    half = (*shape[:axis], shape[axis] // 2, *shape[axis + 1 :])
    (how, gate), (other, up) = (tensor_values(file, name, half, held=held) for name in names)
    if how != other:
        raise JaxinferError(f"{file.path}: {names[0]} is held as {how}, {names[1]} as {other}: one type is read")
    if how == "float":
        return how, np.concatenate([gate, up], axis)
    join = lambda a, b: None if a is None else np.concatenate([a, b])  # noqa: E731  (each array leads with the outputs)
    return how, [tuple(map(join, g, u)) for g, u in zip(gate, up)]


@dataclass(frozen=True)
class _Slice:
    """Matrix e of a stacked tensor [E, out, in] (expert e's of a merged one), as a tensor of its own."""

    tensor: object
    e: int

    @property
    def tensor_type(self):
        return self.tensor.tensor_type

    @property
    def shape(self) -> np.ndarray:
        return self.tensor.shape[:-1]

    @property
    def data(self) -> np.ndarray:
        return self.tensor.data[self.e]


def _scale_and_min(blocks: np.ndarray, method: str) -> tuple:
    """ggml's blocks [n, k/block, bytes] of a scale-and-min format (block_q4_K, _q5_K, _q6_K, _q4_1,
    _q5_1, _q5_0) → what `quant.pack_k` takes: codes [n, k/32, 32] unsigned, the k-quants' sub-scales
    [n, k/32, 2] uint8, super-scales [n, k/block, supers] float16. The `gguf` package's dequantization,
    stopped before the floats."""
    n, count = blocks.shape[:2]
    half = lambda a: a.copy().view(np.float16)  # noqa: E731
    bit = lambda a, shifts, mask: (a[..., None, :] >> np.asarray(shifts, a.dtype)[:, None]) & mask  # noqa: E731
    if method in ("q4_1", "q5_1", "q5_0"):  # d[, m][, qh: 32 fifth bits], qs[16]: byte j values j, j + 16
        codes = bit(blocks[..., -16:], [0, 4], 0x0F).reshape(n, count, 32)
        if method != "q4_1":
            qh = blocks[..., -20:-16].copy().view(np.uint32)
            codes = codes | (bit(qh, range(32), 1).reshape(n, count, 32).astype(np.uint8) << 4)
        if method == "q5_0":  # w = d · (code - 16)
            return codes, None, half(blocks[..., 0:2])
        return codes, None, np.concatenate([half(blocks[..., 0:2]), -half(blocks[..., 2:4])], -1)  # w = d · code + m
    if method == "q6_k":  # ql[128], qh[64], scales[16] int8, d
        ql, qh, scales, d = np.split(blocks, [128, 192, 208], axis=-1)
        low = bit(ql.reshape(n, count, 2, 64), [0, 4], 0x0F).reshape(n, count, 2, 128)
        high = bit(qh.reshape(n, count, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, count, 2, 128)
        return (low | (high << 4)).reshape(n, count * 8, 32), scales.reshape(n, count * 8, 2), half(d)
    d, dmin, scales = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:16].reshape(n, count, 3, 4)
    lo, hi, both = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], -1)  # 6-bit scales and mins, 8 each
    mins = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], -1)
    codes = bit(blocks[..., -128:].reshape(n, count, 4, 32), [0, 4], 0x0F).reshape(n, count, 8, 32)
    if method == "q5_k":  # qh[32]: bit j of byte l the fifth bit of value 32 j + l
        codes = codes | (bit(blocks[..., 16:48], range(8), 0x01) << 4)
    sub = np.stack([sc, mins], -1).reshape(n, count * 8, 2)
    return codes.reshape(n, count * 8, 32), sub, np.concatenate([half(d), half(dmin)], -1)


READ_INTO_CONFIG = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def unmapped(file: GGUFFile, names: set[str]) -> list[str]:
    """The file's tensors that no entry of the table takes (the rope factors are read into the config)."""
    return sorted(set(file.tensors) - {name.partition("#")[0] for name in names} - set(READ_INTO_CONFIG))
