"""Open a model directory (Hugging Face safetensors or our orbax-converted form) into a ready model:
`load_model` reads the weights, `open_model` adds what generating needs (how it decodes, its draft
model, its context); every command that generates opens its model through it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer import defaults, forms, gemma_library, gguf_model, harmony, kernel, weights
from jaxinfer.chat_template import read_template
from jaxinfer.checkpoint import restore_params
from jaxinfer.config import ModelConfig
from jaxinfer.embeddings import Pooler
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_config import POOLING_KEY
from jaxinfer.kvcache import check_kv_dtype
from jaxinfer.modeldir import LAYOUT_KEY, METHODS_KEY, ORBAX_DIR, QUANTIZED_KEY, is_converted, load_config, read_json
from jaxinfer.quant import METHODS, check_method
from jaxinfer.replies import think_markers
from jaxinfer.sampling import Sampling
from jaxinfer.sharding import place
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation
from jaxinfer.tokenizer import Tokenizer

DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATE = ("ngram",)  # drafting without a draft model: prompt lookup


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer
    dtype: str  # storage dtype of the weights (the compute dtype is `model.compute_dtype(params)`)
    quantize: str | None  # "int8" / "int4": the matrices are block-quantized (`jaxinfer.quant`)
    sampling: Sampling  # defaults from generation_config.json
    eos_ids: tuple[int, ...]
    max_new_tokens: int | None  # generation_config.json's, if it sets one
    chat_template: str | None = None  # the Jinja source chats render with (None: the model has none)
    pooler: Pooler = Pooler()  # how its hidden states become a text's embedding (`jaxinfer.embeddings`)

    @property
    def storage(self) -> str:
        """How the weights and cache are held, in words: "float32", "float32, int8 weights, int8 KV",
        "bfloat16, float32 compute", "bfloat16, float32 compute, bfloat16 matmul inputs"."""
        parts = [self.dtype] + ([f"{self.computed_in} compute"] if self.computed_in != self.dtype else [])
        if self.config.matmul_inputs != self.computed_in:
            parts.append(f"{self.config.matmul_inputs} matmul inputs")
        parts += [f"{kind} {name}" for kind, name in ((self.methods, "weights"), (self.config.kv_dtype, "KV")) if kind]
        return ", ".join(parts)

    @property
    def methods(self) -> str | None:
        """The quantized matrices' methods, the most common first: "q8_0", "q4_k/q6_k" (a GGUF file's mix)."""
        return forms.methods_named(forms.methods_of(self.params))

    @property
    def computed_in(self) -> str:
        """The dtype activations and the cache are computed in (the roofs are measured in it)."""
        from jaxinfer.model import compute_dtype

        return jnp.dtype(compute_dtype(self.params)).name

    @property
    def roofed_in(self) -> str:
        """The matmul whose peak bounds this model's products (`roof_dtype`)."""
        return roof_dtype(self.dtype, forms.layout_of(self.params))

    @property
    def kernels(self) -> str:
        """The path its matrices run on: the CPU kernels' (`kernel.isa()`, as "avx2" or
        "avx512-vnni-bf16") where they are held in one of the kernels' forms, else "XLA"."""
        return kernel.isa() if kernel.available() and forms.on_kernel(self.params) else "XLA"

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def check_generates(self) -> None:
        """Refuse to generate with an embedding model's body: it has no LM head."""
        if self.config.headless:
            raise JaxinferError(
                f"{self.path.name} is an embedding model, with no language-model head to generate with: it embeds "
                "(jaxinfer embed; /v1/embeddings and /api/embed of jaxinfer serve)"
            )


def resolve_dtype(requested: str, config_json: dict, layout: str = "out_in") -> str:
    """The dtype the weights are stored in. `auto` is the checkpoint's, except on XLA CPU, whose dot
    converts bf16/fp16 weights to float32 on every call: float32 there, unless the CPU kernel's
    `packed` layout reads bfloat16 as it is stored (same values, computed in float32)."""
    if requested not in DTYPES:
        raise JaxinferError(f"dtype must be one of {', '.join(DTYPES)}, not {requested!r}", "dtype")
    if requested != "auto":
        return requested
    stored = weights.checkpoint_dtype(config_json) or "float32"
    if stored not in DTYPES[1:]:
        return "float32"
    if jax.default_backend() == "cpu":
        return stored if stored == "bfloat16" and layout == "packed" else "float32"
    return stored


def compute_dtype(dtype: str, layout: str) -> str:
    """What activations and the KV cache are computed in: the storage dtype, except that the packed
    layout computes in float32 (`forms.lay_out`)."""
    return "float32" if layout == "packed" else dtype


def float32_products() -> None:
    """float32 products in float32. GPUs run them in TF32 (10-bit mantissas) at JAX's default
    precision: on an H100 the tiny gemma's logits missed transformers' by 0.0163 against a bound of
    0.00066. XLA CPU computes float32 as asked whatever the setting. Process-wide: the precision is
    read as programs are traced."""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")


def roof_dtype(dtype: str, layout: str) -> str:
    """The matmul whose peak bounds the model's products (`ceilings`): packed bfloat16 matrices run
    the CPU kernel's own bfloat16 product (on AMX, past float32's roof), the rest the compute dtype's."""
    return dtype if layout == "packed" and dtype == "bfloat16" else compute_dtype(dtype, layout)


def _eos_ids(config_json: dict, generation: dict, tokenizer: Tokenizer) -> tuple[int, ...]:
    """As transformers' generate: generation_config.json first, then config.json, then the tokenizer."""
    for source in (generation.get("eos_token_id"), config_json.get("eos_token_id"), tokenizer.eos_id):
        if source is not None:
            return tuple(source) if isinstance(source, list) else (int(source),)
    return ()


def stored_quantization(config_json: dict, quantize: str | None) -> str | None:
    """The quantization a model runs with: a converted model's own, else `quantize`."""
    stored = config_json.get(QUANTIZED_KEY)
    if stored and quantize:
        raise JaxinferError(f"this model is already stored quantized ({stored}); run it without quantize", "quantize")
    if stored and stored not in METHODS:
        raise JaxinferError(f"config.json: {QUANTIZED_KEY} {stored!r} is not a quantization jaxinfer knows")
    return stored or check_method(quantize)


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    progress: weights.ProgressFn | None = None,
    layout: str | None = None,
    quantize: str | None = None,
    kv_dtype: str | None = None,
    mesh: Mesh | None = None,
    gguf_file: str | None = None,
    ahead: Callable[[LoadedModel], None] | None = None,
    chat_template: str | None = None,
) -> LoadedModel:
    """Load a model directory or GGUF file; with no path, the bundled default model. `layout`:
    "packed" for the CPU kernel (`jaxinfer.packed`), "in_out" the layers' matrices transposed, "out_in"
    as the checkpoint stores them (`jaxinfer.forms`); by default the fastest here
    (`forms.layout_for_batch(1)`); `quantize` ("int8", "int4", ...) packs the matrices as they load
    (`jaxinfer.quant`; their layout is the packing's own; a GGUF file's quantized matrices stay as the
    file holds them); `gguf_file`: the GGUF file of that name in the hub repository `path`; `kv_dtype`
    "int8" makes every cache built for it int8 (`kvcache`); `mesh` spreads the weights over its devices
    as they are read (`jaxinfer.sharding`). `dtype` "bfloat16" (asked for, not auto's choice) also
    rounds every product's inputs to bfloat16 (`ModelConfig.matmul_inputs`): on the CPU kernel, AMX's
    prefill in one pass instead of two. A float32 model on a GPU sets JAX's default matmul precision
    to "highest" for the process (`float32_products`). `ahead(model)` runs on a thread of its own
    while the weights load, given the model as it will be with its weights abstract
    (`jax.ShapeDtypeStruct`s): what it compiles for them (`engine.compile_ahead`) the real weights
    find built (not for a GGUF file, or over a mesh). `chat_template`: a Jinja chat template to
    render chats with instead of the model's own (llama.cpp's --chat-template-file)."""
    layout = forms.check_layout(layout, mesh is not None)
    model_dir, cfg, config_json = load_config(path, gguf_file)
    gguf = gguf_model.open_gguf(model_dir) if gguf_model.is_gguf(model_dir) else None
    asked = quantize
    quantize = stored_quantization(config_json, quantize)
    cfg = replace(cfg, kv_dtype=check_kv_dtype(kv_dtype))
    generation = {} if gguf else read_json(model_dir / "generation_config.json", required=False)
    if gguf:
        tokenizer = Tokenizer.from_gguf(gguf.meta, str(model_dir))
    else:  # a gemma-library checkpoint's tokenizer.model comes with no settings: the library's
        tokenizer = Tokenizer(
            model_dir, gemma_library.TOKENIZER_CONFIG if gemma_library.checkpoint_of(model_dir) else None
        )
    template = chat_template if chat_template is not None else read_template(model_dir, tokenizer.config)
    speaks_harmony = harmony.is_harmony(template)
    if speaks_harmony:  # gpt-oss: its replies' markers are kept
        tokenizer.keep(harmony.MARKERS)
    if markers := think_markers(template):  # a thinking block's (Magistral's are control tokens)
        tokenizer.keep(markers)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise JaxinferError(
            f"the tokenizer has ids up to {tokenizer.vocab_size - 1} but the embedding table has {cfg.vocab_size} "
            "rows: "
            "they do not belong to the same model"
        )
    if tokenizer.vocab_size < cfg.vocab_size:
        cfg = replace(cfg, sampled_vocab=tokenizer.vocab_size)
    chosen = resolve_dtype(dtype, config_json, layout)
    if dtype == "bfloat16":  # asked for, not auto's choice: products as transformers' bfloat16 runs them
        cfg = replace(cfg, matmul_inputs="bfloat16")
    if compute_dtype(chosen, layout) == "float32":
        float32_products()
    # a GGUF embedding model's pooling is its file's (normalized, as llama.cpp's embeddings are by default)
    pooler = Pooler(config_json.get(POOLING_KEY, "last")) if gguf else Pooler.read(model_dir, tokenizer.config)
    sampling, eos_ids = Sampling.from_generation_config(generation), _eos_ids(config_json, generation, tokenizer)
    if speaks_harmony:  # a reply ends at its answer or a call, whatever EOS the file names (a GGUF file's one)
        eos_ids = tuple(dict.fromkeys(eos_ids + harmony.stop_ids(tokenizer)))

    def model(params: dict) -> LoadedModel:
        max_new = generation.get("max_new_tokens")
        return LoadedModel(
            model_dir, cfg, params, tokenizer, chosen, quantize, sampling, eos_ids, max_new, template, pooler
        )

    compiling = None
    if ahead is not None and gguf is None and mesh is None:
        stored = weights.abstract_params(
            cfg, weights.dtype_from_name(chosen), quantize, None, config_json.get(METHODS_KEY)
        )
        abstract = jax.eval_shape(partial(forms.lay_out, layout=layout), stored)
        compiling = threading.Thread(target=_quietly, args=(ahead, model(abstract)), name="jaxinfer-compile-ahead")
        compiling.start()
    try:
        params = _read(model_dir, cfg, config_json, gguf, chosen, asked, quantize, mesh, progress)
    finally:
        if compiling is not None:  # its programs are ready, or the load failed: nothing is left running
            compiling.join()
    params = forms.lay_out(params, layout, consume=True)
    return model(params if mesh is None else place(params, cfg, mesh))  # the kernel's forms made whole on each device


def _quietly(fn, *args) -> None:
    """A compile ahead: where it fails (a form it did not foresee), the real call compiles as usual."""
    try:
        fn(*args)
    except Exception:
        pass


def _read(model_dir, cfg, config_json, gguf, chosen, asked, quantize, mesh, progress) -> dict:
    """The weights from the directory's files, as `load_model` reads them (in the stored layout)."""
    if gguf:  # its quantized blocks as they are; its float matrices quantized only if asked
        return weights.read_gguf(cfg, gguf, weights.dtype_from_name(chosen), progress, asked, mesh)
    if is_converted(model_dir):
        if cfg.delta_heads and config_json.get(LAYOUT_KEY, 1) < 2:
            raise JaxinferError(
                f"{model_dir}: converted by an earlier jaxinfer, which laid out the DeltaNet layers otherwise; "
                "convert the original again"
            )
        methods = config_json.get(METHODS_KEY)
        abstract = weights.abstract_params(cfg, weights.dtype_from_name(chosen), quantize, mesh, methods)
        return restore_params(model_dir / ORBAX_DIR, abstract)
    files = weights.checkpoint_files(model_dir)
    return weights.read_checkpoint(cfg, files, weights.dtype_from_name(chosen), progress, quantize, mesh)


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's tokenizer: its drafts are verified as token ids."""
    if draft.tokenizer.pieces() != target.tokenizer.pieces():
        raise JaxinferError(
            f"the draft model {draft.path.name} has a different vocabulary from {target.path.name} "
            f"({draft.tokenizer.vocab_size} and {target.tokenizer.vocab_size} tokens, not the same pieces): a draft "
            "must share the tokenizer"
        )


@dataclass
class OpenModel:
    """A model ready to generate: `model` (weights, tokenizer, the checkpoint's defaults), how its rows
    are prefilled and decoded (`decoding`, with the draft model's weights where one drafts) and the
    cache length it runs with (`context`)."""

    model: LoadedModel
    decoding: Decoding
    context: int


def open_model(
    path: str | Path | None = None,
    *,
    dtype: str = "auto",
    quantize: str | None = None,
    kv_dtype: str | None = None,
    layout: str | None = None,
    mesh: Mesh | None = None,
    max_context: int | None = None,
    prefill_chunk: int | None = None,
    speculate: str | None = None,
    num_draft: int | None = None,
    draft_model: str | Path | None = None,
    gguf_file: str | None = None,
    chat_template: str | None = None,
    progress: weights.ProgressFn | None = None,
    ahead: Callable[[OpenModel], None] | None = None,
) -> OpenModel:
    """`load_model` and what generating with it needs. `max_context`: the cache length (default the
    model's trained positions, at most `defaults.MAX_CONTEXT`); `prefill_chunk` as `Decoding`'s;
    `speculate` "ngram" drafts by prompt lookup, `draft_model` (a directory or hub id) with a small
    model sharing the tokenizer, loaded with the same dtype, quantize, kv_dtype and layout onto the
    same mesh; `gguf_file`, `chat_template` as `load_model`'s; `num_draft` tokens a step (default `defaults.NUM_DRAFT`).
    `ahead` as `load_model`'s, given the OpenModel to be (not where a draft model drafts). Every
    parameter is checked before any weights are read."""
    _check_context(max_context)  # before the weights are read
    decoding = Decoding(prefill_chunk, _speculation(speculate, num_draft, draft_model))
    if ahead is not None and draft_model is None:
        given = ahead
        ahead = lambda model: given(OpenModel(model, decoding, context_length(model.max_positions, max_context)))  # noqa: E731
    model = load_model(
        path,
        dtype,
        progress,
        layout,
        quantize,
        kv_dtype,
        mesh,
        gguf_file,
        ahead if draft_model is None else None,
        chat_template,
    )
    if draft_model is not None:
        draft = load_model(draft_model, dtype, progress, layout, quantize, kv_dtype, mesh)
        check_draft(model, draft)
        decoding = Decoding(prefill_chunk, replace(decoding.speculation, model=draft.config), draft.params)
    return OpenModel(model, decoding, context_length(model.max_positions, max_context))


def context_length(max_positions: int, max_context: int | None = None) -> int:
    """The cache length: `max_context`, else the model's trained positions up to `defaults.MAX_CONTEXT`."""
    _check_context(max_context)
    return max_context or min(max_positions, defaults.MAX_CONTEXT)


def _check_context(max_context: int | None) -> None:
    if max_context is not None and max_context < 1:
        raise JaxinferError("max_context must be at least 1", "max_context")


def _speculation(speculate: str | None, num_draft: int | None, draft_model) -> Speculation:
    if speculate not in (None, *SPECULATE):
        raise JaxinferError(f"speculate must be one of {', '.join(SPECULATE)}, not {speculate!r}", "speculate")
    if speculate and draft_model:
        raise JaxinferError(
            "speculate ngram and draft_model are two ways to draft: give one", "speculate", "draft_model"
        )
    if num_draft is not None and not 1 <= num_draft <= 32:
        raise JaxinferError("num_draft must be between 1 and 32", "num_draft")
    if speculate is None and draft_model is None:
        if num_draft is not None:
            raise JaxinferError(
                "num_draft needs speculate ngram or draft_model", "num_draft", "speculate", "draft_model"
            )
        return Speculation()
    return Speculation(draft=num_draft or defaults.NUM_DRAFT)
