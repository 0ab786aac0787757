"""Text embeddings: a model's final hidden states pooled into one vector a text, as
sentence-transformers computes them (the tests' oracle) and as llama.cpp's `--embeddings`, ollama's
/api/embed and OpenAI's /v1/embeddings serve them.

A sentence-transformers model says how in its own files (`Pooler.read`): modules.json lists the body
(our model, headless), a Pooling module (the last token, the mean, the first or the maximum), Dense
modules (a linear map and its activation) and a Normalize module (unit length);
config_sentence_transformers.json its prompts (Qwen3-Embedding's query instruction); the tokenizer's
`model_max_length` (sentence_bert_config.json's `max_seq_length` in older saves) how many tokens it
reads. Any other model pools as the decoder-only embedding models do (Qwen3-Embedding, e5-mistral,
gte-Qwen2: the last token, the only one that has read the whole text under causal attention) and
normalises, as llama.cpp and ollama do.

A pass is one prefill of several texts into a cache of their own (no decode, no LM head): compute-
bound like a prompt's, on the same kernels. Texts are sorted by length and grouped so that a pass
holds at most EMBED_TOKENS tokens, padded to power-of-two rows and near-power-of-two lengths (few
programs); a text's padding comes after it, which a causal model's positions never see, so a text's
vector does not depend on its batch-mates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import model
from jaxinfer.buckets import MIN_BUCKET
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError, boolean, refuse_unknown
from jaxinfer.kvcache import KVCache

POOLINGS = ("last", "mean", "cls", "max")  # llama.cpp's --pooling names
# sentence-transformers' pooling modes (6.x: "pooling_mode"; older: a pooling_mode_*_token flag each)
_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls"}
_MODES |= {"max_tokens": "max", "max": "max"}
_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": np.tanh}  # a Dense module's (sentence-transformers' default Tanh)
# Tokens a pass holds at most, padding included: the bundled model embedded 256 texts of 20–104
# tokens at 6,270 / 6,270 / 5,780 / 5,600 tok/s in passes of 512 / 1024 / 2048 / 4096 (a Zen 4, 2
# cores): past a few hundred tokens a pass is compute-bound, and longer ones only attend further.
EMBED_TOKENS = 1024


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module: x @ weight.T + bias, then its activation."""

    weight: np.ndarray  # [out, in] float32
    bias: np.ndarray | None  # [out]
    activation: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = x @ self.weight.T + (0 if self.bias is None else self.bias)
        return _ACTIVATIONS[self.activation](x).astype(np.float32)


@dataclass(frozen=True)
class Pooler:
    """How a model's hidden states become one vector a text."""

    pooling: str = "last"  # one of POOLINGS
    normalize: bool = True  # to unit length, after the Dense modules
    dense: tuple[Dense, ...] = ()
    prompts: dict = field(default_factory=dict)  # name → the text put before an input of that kind
    default_prompt: str | None = None  # the prompt's name where a request names none
    max_length: int | None = None  # tokens a text may have (prompt and special tokens included)
    include_prompt: bool = True  # False: a mean (or max) leaves the prompt's tokens out
    own: bool = False  # read from the model's sentence-transformers files

    @classmethod
    def read(cls, model_dir: Path, tokenizer_config: dict) -> Pooler:
        """The model's own, from its sentence-transformers files; the default where it has none."""
        if not (model_dir / "modules.json").is_file():
            return cls()
        pooling, normalize, dense = None, False, []
        for module in _modules(model_dir):
            kind, folder = module.get("type", "").rsplit(".", 1)[-1], model_dir / module.get("path", "")
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                pooling, include_prompt = _pooling(folder)
            elif kind == "Dense":
                dense.append(_dense(folder))
            elif kind == "Normalize":
                normalize = True
            else:
                raise JaxinferError(f"{model_dir}: its sentence-transformers module {kind!r} is not one jaxinfer runs")
        if pooling is None:
            raise JaxinferError(f"{model_dir}: modules.json lists no Pooling module: how to pool is not said")
        settings, transformer = (
            _json(model_dir / "config_sentence_transformers.json"),
            _json(model_dir / "sentence_bert_config.json"),
        )
        if "message" in (transformer.get("modality_config") or {}):  # sentence-transformers 6 then always takes it
            raise JaxinferError(
                f"{model_dir}: its sentence-transformers config renders every text through the chat template "
                "(the 'message' modality): jaxinfer embeds plain text only, and would not give its vectors"
            )
        limit = transformer.get("max_seq_length")
        limit = limit or tokenizer_config.get("model_max_length")
        return cls(
            pooling,
            normalize,
            tuple(dense),
            dict(settings.get("prompts") or {}),
            settings.get("default_prompt_name"),
            int(limit) if isinstance(limit, (int, float)) and limit < 1 << 31 else None,
            include_prompt,
            own=True,
        )

    def prompt(self, name: str | None) -> str:
        """The text put before an input: the named prompt's, or the default's."""
        name = name if name is not None else self.default_prompt
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(self.prompts) or "none"
            raise JaxinferError(
                f"prompt_name {name!r}: the model has no prompt of that name (its: {known})", "prompt_name"
            )
        return self.prompts[name]

    def dimensions(self, hidden_size: int) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size


def module_folders(model_dir: Path) -> list[str]:
    """The folders of a sentence-transformers model's modules beside the body (1_Pooling, ...)."""
    if not (model_dir / "modules.json").is_file():
        return []
    return [m["path"] for m in _modules(model_dir) if m.get("path") and (model_dir / m["path"]).is_dir()]


def _json(path: Path):
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise JaxinferError(f"{path}: not valid JSON ({e})") from None


def _modules(model_dir: Path) -> list[dict]:
    modules = _json(model_dir / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise JaxinferError(f"{model_dir / 'modules.json'}: not a list of sentence-transformers modules")
    return modules


def _pooling(folder: Path) -> tuple[str, bool]:
    """A Pooling module's mode (ours) and whether a prompt's tokens are pooled."""
    config = _json(folder / "config.json")
    modes = [config["pooling_mode"]] if "pooling_mode" in config else []
    modes += [key.removeprefix("pooling_mode_") for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _MODES:
        said = " and ".join(map(repr, modes)) or "none"
        raise JaxinferError(f"{folder}: pooling mode {said}; jaxinfer pools by one of lasttoken, mean, cls, max")
    return _MODES[modes[0]], bool(config.get("include_prompt", True))


def _dense(folder: Path) -> Dense:
    from safetensors.numpy import load_file

    config = _json(folder / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise JaxinferError(f"{folder}: a Dense module's activation {activation!r} is not one jaxinfer runs")
    if not (folder / "model.safetensors").is_file():
        raise JaxinferError(f"{folder}: no model.safetensors (pytorch .bin files are not read)")
    tensors = load_file(folder / "model.safetensors")
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    if weight is None or weight.shape != (config.get("out_features"), config.get("in_features")):
        raise JaxinferError(f"{folder}: its linear.weight does not match its in_features and out_features")
    return Dense(weight.astype(np.float32), None if bias is None else bias.astype(np.float32), activation)


def encode(tokenizer, text: str, pooler: Pooler, limit: int, prompt: str = "", truncate: bool = False) -> list[int]:
    """A text's ids as the model embeds it: after the prompt, within `limit` tokens (its first
    ones where `truncate`, else refused)."""
    ids = tokenizer.encode(prompt + text)
    if len(ids) > limit:
        if not truncate:
            raise JaxinferError(
                f"an input has {len(ids)} tokens, over the {limit} this model embeds: shorten it, or truncate it",
                "truncate",
            )
        ids = tokenizer.encode(prompt + text, max_length=limit)
    if not ids:
        raise JaxinferError("an input is empty: it has no tokens to embed", "input")
    return ids


def prompt_tokens(tokenizer, pooler: Pooler, prompt: str) -> int:
    """The leading tokens a mean or max leaves out: the prompt's where the model pools without it,
    counted as sentence-transformers counts them (its ids, a BOS included, less a special token it
    ends with)."""
    if pooler.include_prompt or not prompt:
        return 0
    ids = tokenizer.encode(prompt)
    return len(ids) - bool(ids and ids[-1] in tokenizer.special_ids)


def embed(
    params: dict, cfg: ModelConfig, pooler: Pooler, inputs: list[list[int]], skips: list[int] | None = None
) -> np.ndarray:
    """[N, D] float32: each input's ids pooled (leaving its first `skips[i]` tokens out of a mean or
    max), through the Dense modules, normalised where the pooler says."""
    skips = skips or [0] * len(inputs)
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    for group in passes([len(ids) for ids in inputs]):
        T, R = _bucket(max(len(inputs[j]) for j in group)), _rows(len(group))
        tokens, lengths, skip = np.zeros((R, T), np.int32), np.ones(R, np.int32), np.zeros(R, np.int32)
        for row, j in enumerate(group):
            tokens[row, : len(inputs[j])], lengths[row], skip[row] = inputs[j], len(inputs[j]), skips[j]
        pooled = np.asarray(jax.device_get(_pooled(params, tokens, lengths, skip, cfg, pooler.pooling)))
        for row, j in enumerate(group):
            vectors[j] = pooled[row]
    out = np.stack(vectors) if vectors else np.zeros((0, cfg.hidden_size), np.float32)
    for dense in pooler.dense:
        out = dense(out)
    return normalized(out) if pooler.normalize else out


@dataclass
class Job:
    """Texts to embed (their ids; the leading tokens a mean leaves out of each: `embed`'s skips),
    put in a scheduler's inbox beside requests: the scheduler embeds every one waiting in its next
    round, between decode steps (`run_jobs`), and `done` is called from its thread with their
    vectors [N, D] or what failed."""

    inputs: list[list[int]]
    skips: list[int]
    done: Callable[[np.ndarray | Exception], None]


def run_jobs(model, jobs: list[Job]) -> None:
    """Every job's texts embedded together (`embed` groups them into passes), each job handed its
    own vectors; a failure (the device's) handed to each instead."""
    if not jobs:
        return
    inputs, skips = [ids for job in jobs for ids in job.inputs], [n for job in jobs for n in job.skips]
    try:
        vectors = embed(model.params, model.config, model.pooler, inputs, skips)
    except Exception as e:
        for job in jobs:
            job.done(e)
        return
    at = 0
    for job in jobs:
        job.done(vectors[at : at + len(job.inputs)])
        at += len(job.inputs)


def shortened(vectors: np.ndarray, dimensions: int | None, pooler: Pooler) -> np.ndarray:
    """The first `dimensions` of each vector (a Matryoshka model's smaller embedding: OpenAI's
    `dimensions`), normalised again where the pooler normalises."""
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    cut = vectors[:, :dimensions]
    return normalized(cut) if pooler.normalize else cut


def normalized(x: np.ndarray) -> np.ndarray:
    """Rows to unit length (torch's F.normalize: a zero row stays zero)."""
    return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


def passes(lengths: list[int]) -> list[list[int]]:
    """The inputs (by index) each pass embeds: shortest first, as many as fit EMBED_TOKENS once
    padded (a longer one alone)."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if out and _rows(len(out[-1]) + 1) * _bucket(lengths[i]) <= EMBED_TOKENS:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _bucket(n: int) -> int:
    """A pass's padded length: a power of two, or three quarters of one. Texts of 10–60 words
    padded to powers of two held 1.55 tokens for each real one, to these 1.26, and embedded 463 →
    590 tok/s (`scripts/bench_embed.py`'s model, 8 layers: a Zen 4, 2 cores), for twice the programs."""
    power = max(MIN_BUCKET, 1 << (n - 1).bit_length())
    return power * 3 // 4 if power >= 32 and n <= power * 3 // 4 else power


def _rows(n: int) -> int:
    return 1 << (n - 1).bit_length()


@partial(jax.jit, static_argnames=("cfg", "pooling"))
def _pooled(
    params: dict, tokens: jax.Array, lengths: jax.Array, skip: jax.Array, cfg: ModelConfig, pooling: str
) -> jax.Array:
    """Rows of tokens [R, T] (the first `lengths` [R] of each real) prefilled into a fresh cache:
    their final hidden states pooled, [R, D] float32, a mean or max over tokens `skip` [R] on."""
    R, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    live = positions < lengths[:, None]  # [R, T]: the bucket's padding moves no recurrent state
    cache = KVCache.zeros(cfg, R, T, model.compute_dtype(params))
    block = model.Block(tokens, positions, T, None, lengths[:, None], fresh=True, live=live)
    (hidden,), _ = model.forward_blocks(params, cfg, [block], cache)
    hidden = hidden.astype(jnp.float32)  # [R, T, D]
    pooled = live & (positions >= skip[:, None])
    if pooling == "last":
        return jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "max":
        return jnp.max(jnp.where(pooled[..., None], hidden, -1e9), axis=1)
    counts = jnp.maximum(pooled.sum(1, keepdims=True), 1e-9)
    return jnp.sum(jnp.where(pooled[..., None], hidden, 0.0), axis=1) / counts


# Requests, as the endpoints take them ----------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """An embedding request: its inputs (texts, or lists of token ids) and how its vectors come back."""

    inputs: list
    dimensions: int | None = None  # the first this many of each vector (`shortened`)
    truncate: bool = False  # an input over the model's limit: its first tokens (else refused)
    prompt_name: str | None = None  # the model's prompt put before each text (`Pooler.prompt`)
    base64: bool = False  # each vector as base64 of little-endian float32 (OpenAI's clients ask so)


def read_openai(body: dict) -> Asked:
    """/v1/embeddings' body: OpenAI's fields (`user` ignored), with text-embeddings-inference's
    `truncate` and `prompt_name`."""
    body = {k: v for k, v in body.items() if v is not None}  # null: not given
    refuse_unknown(body, {"input", "model", "encoding_format", "dimensions", "user", "truncate", "prompt_name"})
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise JaxinferError('"encoding_format" must be "float" or "base64"', "encoding_format")
    return Asked(
        inputs_of(body.get("input")),
        dimensions_of(body),
        boolean(body, "truncate", False),
        _name(body.get("prompt_name")),
        body.get("encoding_format") == "base64",
    )


def inputs_of(value, field: str = "input") -> list:
    """A request's inputs: a text, a list of texts, token ids, or a list of lists of them."""
    ids = lambda v: isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)  # noqa: E731
    if isinstance(value, str) or ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        return value
    raise JaxinferError(f'"{field}" must be a text, a list of texts, or token ids (a list, or lists of them)', field)


def dimensions_of(body: dict) -> int | None:
    value = body.get("dimensions")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise JaxinferError('"dimensions" must be a whole number ≥ 1', "dimensions")
    return value


def _name(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise JaxinferError('"prompt_name" must be the name of one of the model\'s prompts', "prompt_name")
    return value


def tokenized(model, asked: Asked, context: int) -> tuple[list[list[int]], list[int]]:
    """Each input's ids (a text after the prompt, within the model's limit and `context`) and the
    leading tokens a mean leaves out of it (`embed`'s skips)."""
    pooler, tokenizer = model.pooler, model.tokenizer
    if asked.dimensions is not None and asked.dimensions > (most := pooler.dimensions(model.config.hidden_size)):
        raise JaxinferError(f'"dimensions" must be at most {most}, the model\'s', "dimensions")
    limit = min(pooler.max_length or context, context)
    prompt = pooler.prompt(asked.prompt_name)
    skip = prompt_tokens(tokenizer, pooler, prompt)
    ids, skips = [], []
    for given in asked.inputs:
        if isinstance(given, str):
            ids.append(encode(tokenizer, given, pooler, limit, prompt, asked.truncate))
            skips.append(skip)
            continue
        if any(not 0 <= i < tokenizer.vocab_size for i in given):
            raise JaxinferError(f"an input's token id is not one of this model's (0 to {tokenizer.vocab_size - 1})")
        if len(given) > limit and not asked.truncate:
            raise JaxinferError(f"an input has {len(given)} tokens, over the {limit} this model embeds", "input")
        ids.append(list(given[:limit]))
        skips.append(0)
    return ids, skips


def openai_answer(vectors: np.ndarray, asked: Asked, model_name: str, tokens: int) -> dict:
    """/v1/embeddings' answer: OpenAI's list of embeddings, in the inputs' order."""
    import base64

    def encoded(v: np.ndarray):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if asked.base64 else v.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}
