"""Google DeepMind's `gemma` library's checkpoints (the Flax weights Kaggle and the hub's JAX
repositories ship, and what `gm.ckpts.save_params` writes after a fine-tune): an orbax checkpoint of
the library's parameter tree (`layer_N/attn/q_einsum/w`, `kv_einsum`, `attn_vec_einsum`,
`mlp/gating_einsum`, `mlp/linear`, norms' `scale`), with the sentencepiece tokenizer.model beside it.
Like a GGUF file, such a directory stands for a model directory: `config_json` is the config.json
it stands for (the library's model constants, by the family the tree's sizes or the directory's
name say), `Tensors` its tensors under the names transformers gives them, so the one weight table
reads them.

The tree comes in the library's layouts (`gm.ckpts._CheckpointType`): FLAT (`transformer/layer_0/...`
as the releases were made), NESTED (`model.init`'s tree), STACKED (the layers of each attention
type stacked on a leading axis), a kauldron trainer's state (its `params`). A multimodal Gemma 3's
vision tower is left unread (the text tower is the language model)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxinfer.errors import JaxinferError

# What marks a directory an orbax checkpoint (its metadata files, in the formats orbax has written)
ORBAX_MARKS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "checkpoint")

# The library's models (`gm.nn.Gemma2_2B` ..., and gemma 2.x's TransformerConfig.gemma_2b/7b): what the
# tree's shapes do not say. version, layers, embed dim (with the version, they name the model),
# sliding window, whether the queries scale by (embed / heads)^-1/2 (not head_dim's), the global
# layers' rope scale, the context it was trained for.
MODELS = {
    "gemma-2b": (1, 18, 2048, None, False, None, 8192),
    "gemma-7b": (1, 28, 3072, None, False, None, 8192),
    "gemma2-2b": (2, 26, 2304, 4096, False, None, 8192),
    "gemma2-9b": (2, 42, 3584, 4096, False, None, 8192),
    "gemma2-27b": (2, 46, 4608, 4096, True, None, 8192),
    "gemma3-270m": (3, 18, 640, 512, False, None, 32768),
    "gemma3-1b": (3, 26, 1152, 512, False, None, 32768),
    "gemma3-4b": (3, 34, 2560, 1024, False, 8.0, 131072),
    "gemma3-12b": (3, 48, 3840, 1024, False, 8.0, 131072),
    "gemma3-27b": (3, 62, 5376, 1024, True, 8.0, 131072),
}
_NAMED = re.compile(r"(gemma[23]?)-(\d+(?:\.\d+)?[bm])")
_VISION = ("vision_encoder/", "SigLiPFromPatches_0/", "embedder/mm_")
# The library's chat format (`gm.text.ChatSampler`'s turns); a system message opens the first user turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}


def checkpoint_of(model_dir: Path) -> Path | None:
    """The orbax checkpoint a gemma-library directory holds (the directory itself, or its one
    checkpoint inside, as Kaggle's `gemma2-2b-it/gemma2-2b-it/`); None for anything else."""
    if not model_dir.is_dir() or (model_dir / "config.json").exists():
        return None
    if _is_orbax(model_dir):
        return model_dir
    inside = [d for d in model_dir.iterdir() if d.is_dir() and _is_orbax(d)]
    return inside[0] if len(inside) == 1 else None


def home(path: Path) -> Path:
    """The model directory of a checkpoint named directly: its parent where the tokenizer is there."""
    if _is_orbax(path) and not (path / "tokenizer.model").is_file() and (path.parent / "tokenizer.model").is_file():
        return path.parent
    return path


def _is_orbax(path: Path) -> bool:
    return any((path / mark).is_file() for mark in ORBAX_MARKS)


class Leaf(NamedTuple):
    path: tuple  # where the array is in the checkpoint's tree
    index: int | None  # its slice of a STACKED array
    shape: tuple
    dtype: np.dtype
    group: tuple  # what is restored with it: its layer (or its own top-level entry)


def leaves(checkpoint: Path) -> dict[str, Leaf]:
    """The checkpoint's leaves from orbax's metadata (nothing else is read), by their name in the
    library's NESTED tree ("layer_0/attn/q_einsum": the library's prefixes, a trainer's state and the
    einsums' `w` taken off; a STACKED array's slices as the layers they are)."""
    from flax import traverse_util

    tree = _orbax(checkpoint, lambda checkpointer, path: checkpointer.metadata(path))
    tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
    root = ("params",) if isinstance(tree, dict) and isinstance(tree.get("params"), dict) else ()  # a trainer's
    if root:
        tree = tree["params"]
    found = traverse_util.flatten_dict(tree)
    pattern = 1 + max(
        (int(m[1]) for path in found if (m := re.search(r"attention_type_(\d+)", "/".join(path)))), default=-1
    )
    out = {}
    for path, meta in found.items():
        key = "/".join(path).removeprefix("transformer/").removesuffix("/w")
        layer = re.match(r"(?:transformer/)?(layer_\d+)", path[0])
        group = root + ((layer[1],) if layer else path[:1])
        stacked = re.match(r"stacked_layers/attention_type_(\d+)/(.*)", key)
        if stacked is None:
            out[key] = Leaf(root + path, None, tuple(meta.shape), meta.dtype, group)
            continue
        for j in range(meta.shape[0]):  # slice j of attention type i is layer j·pattern + i
            name = f"layer_{j * pattern + int(stacked[1])}/{stacked[2]}"
            out[name] = Leaf(root + path, j, tuple(meta.shape[1:]), meta.dtype, root + path[:1])
    return out


def _orbax(checkpoint: Path, read):
    """`read(checkpointer, path)`, orbax's and TensorStore's many errors worded as one."""
    import orbax.checkpoint as ocp

    from jaxinfer.checkpoint import quiet_leftovers

    undo = quiet_leftovers()
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            result = read(checkpointer, checkpoint.resolve())
    except Exception as e:  # orbax and TensorStore raise many kinds; their leftovers stay quiet from here on
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise JaxinferError(f"{checkpoint}: cannot read the orbax checkpoint ({first[:300]})") from None
    undo()
    return result


def _restore(checkpoint: Path, paths: list[tuple]) -> dict[tuple, np.ndarray]:
    """Those arrays of the tree alone, as numpy arrays (orbax's partial restore)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import traverse_util

    def read(checkpointer, path):
        meta = checkpointer.metadata(path)
        meta = traverse_util.flatten_dict(getattr(getattr(meta, "item_metadata", meta), "tree", meta))
        item = traverse_util.unflatten_dict({p: meta[p] for p in paths})
        arguments = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        return checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(item=item, restore_args=arguments, partial_restore=True)
        )

    return traverse_util.flatten_dict(_orbax(checkpoint, read))


def config_json(model_dir: Path, checkpoint: Path) -> dict:
    """The config.json (Gemma/Gemma2/Gemma3ForCausalLM's) the tree stands for: sizes from its shapes
    (nothing else is read), the rest from its family (by its version and sizes, else the directory's
    name); its EOS ids the tokenizer's EOS and <end_of_turn>."""
    flat = leaves(checkpoint)
    version = _version(flat)
    try:
        vocab, embed = flat["embedder/input_embedding"].shape
        layers = 1 + max(int(m.group(1)) for k in flat if (m := re.match(r"layer_(\d+)/", k)))
        hidden = flat["layer_0/mlp/linear"].shape[0]
        if "layer_0/attn/qkv_einsum" in flat:
            _, heads, _, head_dim = flat["layer_0/attn/qkv_einsum"].shape
            kv_heads = heads
        else:
            heads, _, head_dim = flat["layer_0/attn/q_einsum"].shape
            kv_heads = flat["layer_0/attn/kv_einsum"].shape[1]
    except (KeyError, ValueError) as e:
        raise JaxinferError(f"{checkpoint}: not a gemma-library checkpoint of a Gemma model (no {e})") from None
    family = _family(model_dir, checkpoint, version, layers, embed)
    _, _, _, window, by_embed, scale, context = MODELS[family]
    arch = {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}[version]
    d = {
        "architectures": [arch],
        "model_type": {1: "gemma", 2: "gemma2", 3: "gemma3_text"}[version],
        "gemma_library_family": family,
        "vocab_size": int(vocab),
        "hidden_size": int(embed),
        "intermediate_size": int(hidden),
        "num_hidden_layers": layers,
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": str(flat["embedder/input_embedding"].dtype),
        **(
            {"eos_token_id": eos_ids(model_dir / "tokenizer.model")}
            if (model_dir / "tokenizer.model").is_file()
            else {}
        ),
    }
    if version > 1:
        every = 2 if version == 2 else 6
        d.update(
            sliding_window=window,
            layer_types=["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)],
            query_pre_attn_scalar=embed // heads if by_embed else int(head_dim),
        )
    if version == 2:
        d.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if version == 3:
        d.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
        if scale:
            d["rope_scaling"] = {"rope_type": "linear", "factor": scale}
    return d


def _version(flat: dict) -> int:
    """Gemma 3 has q/k norms, Gemma 2 norms on each block's outputs, Gemma 1 neither."""
    return 3 if any("_query_norm" in k for k in flat) else 2 if any("post_attention_norm" in k for k in flat) else 1


def _family(model_dir: Path, checkpoint: Path, version: int, layers: int, embed: int) -> str:
    """The library model of this version and size; else the one the directory's name gives."""
    for name, (v, n, e, *_) in MODELS.items():
        if (v, n, e) == (version, layers, embed):
            return name
    for where in (checkpoint.name, model_dir.name):
        m = _NAMED.search(where.lower())
        if m and f"{m.group(1)}-{m.group(2)}" in MODELS:
            name = f"{m.group(1)}-{m.group(2)}"
            if MODELS[name][0] != version:
                raise JaxinferError(
                    f"{model_dir}: its name says {name}, but its tree is a Gemma {version}'s"
                    + (" (no post norms)" if version == 1 else " (no q/k norms)" if version == 2 else " (q/k norms)")
                )
            return name
    raise JaxinferError(
        f"{model_dir}: a Gemma {version} gemma-library checkpoint of {layers} layers of {embed}, which is none of "
        f"the library's models; name its directory after the one whose settings it has ({', '.join(MODELS)}), "
        "e.g. gemma2-2b-mine"
    )


def eos_ids(tokenizer_file: Path) -> list[int]:
    """The sentencepiece model's EOS and <end_of_turn> (where a chat turn ends)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_file))
    turn = sp.piece_to_id("<end_of_turn>")
    return [sp.eos_id()] + ([turn] if turn != sp.unk_id() else [])


class Tensors:
    """The checkpoint's tensors under transformers' names, with a safetensors handle's `keys` and
    `get_tensor`: the library's einsum weights cut and laid out as transformers' matrices ([out, in]).
    A layer is read from disk (orbax's partial restore) when its first tensor is asked for, and
    dropped when its last one has been: the load holds the model and one layer, not two models
    (a STACKED checkpoint's arrays hold every layer of a kind: those are held until all are read)."""

    def __init__(self, checkpoint: Path):
        self.checkpoint, self.leaves = checkpoint, leaves(checkpoint)
        version = _version(self.leaves)
        linear = self.leaves.get("layer_0/mlp/linear")
        self.tensors: dict[str, tuple] = {}  # name → (leaf, its tensor from the leaf's array)
        for key, leaf in self.leaves.items():
            if not key.startswith(_VISION):
                for name, make in _named(key, version, linear.shape[0] if linear else None):
                    self.tensors[name] = (leaf, make)
        groups = list(dict.fromkeys(leaf.group for leaf, _ in self.tensors.values()))
        self.tensors = dict(sorted(self.tensors.items(), key=lambda item: groups.index(item[1][0].group)))
        self.waiting = Counter(leaf.group for leaf, _ in self.tensors.values())
        self.held: dict[tuple, dict] = {}  # a group's arrays, while some of its tensors are still to come

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> np.ndarray:
        leaf, make = self.tensors.pop(name)
        if leaf.group not in self.held:
            paths = {other.path for other in self.leaves.values() if other.group == leaf.group}
            self.held[leaf.group] = _restore(self.checkpoint, sorted(paths))
        array = self.held[leaf.group][leaf.path]
        self.waiting[leaf.group] -= 1
        if not self.waiting[leaf.group]:
            del self.held[leaf.group]
        return make(array if leaf.index is None else array[leaf.index])


def _matrix(part: int | None = None, heads_in: bool = False):
    """An einsum weight (its `part` of a stacked q/k/v or k/v) as [out, in]: [N, D, H] → [N·H, D];
    `heads_in` [N, H, D] → [D, N·H]."""

    def make(w: np.ndarray) -> np.ndarray:
        w = w if part is None else w[part]
        return w.reshape(-1, w.shape[-1]).T if heads_in else w.transpose(0, 2, 1).reshape(-1, w.shape[1])

    return make


def _named(key: str, version: int, hidden: int | None) -> list[tuple]:
    """(transformers' name, its tensor as a function of the leaf's array) for one of the tree's leaves."""
    if key == "embedder/input_embedding":
        return [("model.embed_tokens.weight", _same)]
    if key == "final_norm/scale":
        return [("model.norm.weight", _same)]
    m = re.fullmatch(r"layer_(\d+)/(.+)", key)
    if m is None:
        return [(key, _same)]  # the table refuses it by its name
    layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
    norms = {
        "pre_attention_norm/scale": "input_layernorm",
        "post_attention_norm/scale": "post_attention_layernorm",
        # Gemma 1's one norm before the MLP is transformers' post_attention_layernorm
        "pre_ffw_norm/scale": "pre_feedforward_layernorm" if version > 1 else "post_attention_layernorm",
        "post_ffw_norm/scale": "post_feedforward_layernorm",
        "attn/_query_norm/scale": "self_attn.q_norm",
        "attn/_key_norm/scale": "self_attn.k_norm",
    }
    if rest in norms:
        return [(f"{layer}{norms[rest]}.weight", _same)]
    attn = f"{layer}self_attn."
    if rest == "attn/q_einsum":
        return [(f"{attn}q_proj.weight", _matrix())]
    if rest == "attn/kv_einsum":
        return [(f"{attn}{p}_proj.weight", _matrix(i)) for i, p in enumerate("kv")]
    if rest == "attn/qkv_einsum":
        return [(f"{attn}{p}_proj.weight", _matrix(i)) for i, p in enumerate("qkv")]
    if rest == "attn/attn_vec_einsum":
        return [(f"{attn}o_proj.weight", _matrix(heads_in=True))]
    if rest == "mlp/gating_einsum":  # [2, hidden, embed] (transposed, as most models) or [2, embed, hidden]
        return [
            (f"{layer}mlp.{p}_proj.weight", lambda w, i=i: w[i] if w.shape[1] == hidden else w[i].T)
            for i, p in enumerate(("gate", "up"))
        ]
    if rest == "mlp/linear":  # [hidden, embed]
        return [(f"{layer}mlp.down_proj.weight", np.transpose)]
    return [(f"{layer}{rest}", _same)]


def _same(w: np.ndarray) -> np.ndarray:
    return w
