"""The matchers of constrained rows (`jaxinfer.constrain` says what a constraint is): one
llguidance matcher per row, advanced inside the decode programs.

How the mask reaches the device: the decode programs call the host once per step, after the step's
tokens are appended (`HostCall`): `Matchers.advance` feeds each constrained row's new token to its
matcher and returns every row's next bitmask, which the next step's sampling applies. Before a
verifying pass (speculation), `Matchers.check` takes the rows' drafts and gives the mask of each
position after them. On the CPU the call is a custom call of our kernels (kernels/constrain.cc),
which drive llguidance's matchers through its C API with no Python in the step; elsewhere a Python
callback reaches the same functions. The loop never leaves the device (no dispatch per token), and
only programs of a state that constrains hold the calls: a job without constraints compiles and
runs exactly as before. A row without a constraint has every bit set, so its tokens are those it
makes alone.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass

import numpy as np

from jaxinfer.constrain import Constraint, checked_grammar, first_line, mask_words
from jaxinfer.errors import JaxinferError


def check_for(constraint: Constraint, tokenizer, vocab: int, eos_ids: tuple[int, ...]) -> None:
    """Refuse a constraint this model's vocabulary cannot begin to spell (a batch line's, before its
    job admits it: an admission that fails would end the job)."""
    _libraries()[0].llg_free_matcher(_matcher(constraint, _vocabulary(tokenizer, vocab, eos_ids))[0])


class _Limits(ctypes.Structure):  # llguidance.h's LlgParserLimits
    _fields_ = [
        ("max_items_in_row", ctypes.c_size_t),
        ("initial_lexer_fuel", ctypes.c_uint64),
        ("step_lexer_fuel", ctypes.c_uint64),
        ("step_max_items", ctypes.c_size_t),
        ("max_lexer_states", ctypes.c_size_t),
        ("max_grammar_size", ctypes.c_size_t),
        ("precompute_large_lexemes", ctypes.c_bool),
        ("verbose_errors", ctypes.c_bool),
    ]


class _MatcherInit(ctypes.Structure):  # LlgConstraintInit
    _fields_ = [
        ("tokenizer", ctypes.c_void_p),
        ("log_buffer_level", ctypes.c_uint32),
        ("log_stderr_level", ctypes.c_uint32),
        ("ff_tokens_ok", ctypes.c_bool),
        ("backtrack_ok", ctypes.c_bool),
        ("limits", _Limits),
    ]


_TOKENIZE = ctypes.CFUNCTYPE(
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint8),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_size_t,
)


class _TokenizerInit(ctypes.Structure):  # LlgTokenizerInitV2 (its size first: later fields default to zero)
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("vocab_size", ctypes.c_uint32),
        ("tok_eos", ctypes.c_uint32),
        ("token_lens", ctypes.c_void_p),
        ("token_bytes", ctypes.c_void_p),
        ("tokenizer_json", ctypes.c_char_p),
        ("tokenize_assumes_string", ctypes.c_bool),
        ("tokenize_fn", _TOKENIZE),
        ("use_approximate_greedy_tokenize_fn", ctypes.c_bool),
        ("tokenize_user_data", ctypes.c_void_p),
        ("slices", ctypes.c_void_p),
        ("tok_eos_extra", ctypes.c_void_p),
        ("tok_eos_extra_count", ctypes.c_uint32),
    ]


# llguidance's functions the step calls, in the order `jaxinfer_matchers_bind` takes them
_STEP_FUNCTIONS = (
    "llg_matcher_consume_token",
    "llg_matcher_compute_mask_into",
    "llg_matcher_is_stopped",
    "llg_matcher_is_error",
    "llg_matcher_validate_tokens",
    "llg_matcher_rollback",
    "llg_matcher_is_accepting",
    "llg_free_matcher",
)


@functools.cache
def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """llguidance's C API (the library its Python package loads exports it) and our kernels
    (kernels/constrain.cc), which run each step's matcher work with llguidance's step functions."""
    import llguidance._lib

    from jaxinfer import kernel

    kernels = kernel.library()
    if kernels is None:
        raise JaxinferError("constrained output needs jaxinfer's compiled kernels: reinstall it with a C++ compiler")
    llg = ctypes.CDLL(llguidance._lib.__file__)
    p, size = ctypes.c_void_p, ctypes.c_size_t
    for name, restype, argtypes in (
        ("llg_new_tokenizer_v2", p, (p, ctypes.c_char_p, size)),
        ("llg_constraint_init_set_defaults", None, (p, p)),
        ("llg_new_matcher", p, (p, ctypes.c_char_p, ctypes.c_char_p)),
        ("llg_matcher_get_error", ctypes.c_char_p, (p,)),
        ("llg_matcher_compute_mask_into", ctypes.c_int32, (p, p, size)),
        ("llg_free_matcher", None, (p,)),
    ):
        getattr(llg, name).restype, getattr(llg, name).argtypes = restype, argtypes
    step = [ctypes.cast(getattr(llg, name), p).value for name in _STEP_FUNCTIONS]
    kernels.jaxinfer_matchers_bind((p * len(step))(*step))
    i64 = ctypes.c_int64
    for name, restype, argtypes in (
        ("jaxinfer_matchers_new", i64, (i64, i64, p, i64, p, p)),
        ("jaxinfer_matchers_free", None, (i64,)),
        ("jaxinfer_matchers_start", None, (i64, i64, p, ctypes.c_bool)),
        ("jaxinfer_matchers_complete", ctypes.c_bool, (i64, i64)),
        ("jaxinfer_matchers_steps", i64, (i64,)),
        ("jaxinfer_matchers_advance", None, (i64, p, i64, p)),
        ("jaxinfer_matchers_check", None, (i64, p, i64, p)),
    ):
        getattr(kernels, name).restype, getattr(kernels, name).argtypes = restype, argtypes
    return llg, kernels


class _LlgTokenizer:
    """Our tokenizer as llguidance's C API takes one (`llg_new_tokenizer_v2`): each token's bytes
    (special tokens marked by a leading 0xFF, as llguidance's llama.cpp bridge does) and a tokenize
    function, which llguidance calls to spell bytes a grammar forces. Built once per vocabulary
    (~50 ms at 49k tokens) and kept for the process (the matchers hold it)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: tuple[int, ...]):
        words = _Vocabulary(tokenizer, vocab)
        self.vocab_size = vocab
        lens = np.array([len(t) for t in words.tokens], np.uint32)
        data = np.frombuffer(b"".join(words.tokens) or b"\0", np.uint8)
        eos = np.array([i for i in eos_ids if 0 <= i < vocab] or [words.eos_token_id], np.uint32)

        def tokenize(_, text, n, out, room):
            try:
                ids = words(ctypes.string_at(text, n))
            except Exception:  # noqa: BLE001 - nothing can be raised through llguidance: no tokens is its "cannot"
                return 0
            for i, token in enumerate(ids[:room]):
                out[i] = token
            return len(ids)

        self._keep = (lens, data, eos, _TOKENIZE(tokenize))  # llguidance reads them while the tokenizer lives
        self.lens, self.data = lens, data
        init = _TokenizerInit(
            struct_size=ctypes.sizeof(_TokenizerInit),
            vocab_size=vocab,
            tok_eos=int(eos[0]),
            token_lens=lens.ctypes.data,
            token_bytes=data.ctypes.data,
            tokenize_assumes_string=True,  # ours reads text: llguidance gives it UTF-8 pieces, the rest greedily
            tokenize_fn=self._keep[3],
            tok_eos_extra=eos[1:].ctypes.data,
            tok_eos_extra_count=len(eos) - 1,
        )
        error = ctypes.create_string_buffer(1024)
        self.pointer = _libraries()[0].llg_new_tokenizer_v2(ctypes.byref(init), error, len(error))
        if not self.pointer:
            raise JaxinferError(f"llguidance cannot read this tokenizer: {first_line(error.value.decode())}")


@functools.cache
def _vocabulary(tokenizer, vocab: int, eos_ids: tuple[int, ...]) -> _LlgTokenizer:
    return _LlgTokenizer(tokenizer, vocab, eos_ids)


def _matcher(constraint: Constraint, vocabulary: _LlgTokenizer) -> tuple[int, np.ndarray]:
    """A fresh matcher for `constraint` (llguidance's pointer: the caller frees it, or hands it to
    `jaxinfer_matchers_start`) and its first mask [W]."""
    llg = _libraries()[0]
    what = constraint.kind.replace("_", " ")
    init = _MatcherInit()
    llg.llg_constraint_init_set_defaults(ctypes.byref(init), vocabulary.pointer)
    init.log_buffer_level = init.log_stderr_level = 0
    matcher = llg.llg_new_matcher(ctypes.byref(init), b"llguidance", checked_grammar(constraint).encode())
    mask = np.full(mask_words(vocabulary.vocab_size), -1, np.int32)
    error = llg.llg_matcher_get_error(matcher)
    if error is None and llg.llg_matcher_compute_mask_into(matcher, mask.ctypes.data, mask.nbytes) == 0:
        if mask.any():
            return matcher, mask
        error = b""
    else:
        error = llg.llg_matcher_get_error(matcher) or b"unknown error"
    llg.llg_free_matcher(matcher)
    if error:
        raise JaxinferError(f"the {what} cannot be compiled: {first_line(error.decode(errors='replace'))}")
    raise JaxinferError(f"no token of this model's vocabulary can begin the {what}")


@functools.cache
def _host_primitive():
    """A primitive that runs the matchers' step on the host, inside a decode program: param `step`
    ("advance" or "check", the `Matchers` method), `matchers`, and the `result`'s shape.

    On the CPU it is a custom call of our kernels (kernels/constrain.cc), with no Python in the
    step. Elsewhere (a GPU; several CPU devices) it is a Python callback to the same functions: the lowering
    `jax.experimental.io_callback` makes, less its wrapper, which device_puts the arguments into new
    jax.Arrays under a default-device context on every call. The bundled model (a 0.45 ms step, a
    Zen 4, `python scripts/bench_constrained.py`), a constrained row ÷ a free one: ×0.60 through
    io_callback, ×0.78 through the Python callback, ×0.97 through the custom call."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    host = Primitive("jaxinfer_matchers")
    host.def_abstract_eval(lambda x, *, step, matchers, result: result)

    def maximal(ctx):
        # over a mesh: once, on the first device (a maximal sharding), its result given to all; the
        # choice is io_callback's own, private functions: should a JAX release move them, one device
        # still works (a mesh then fails to compile, saying the call needs a sharding)
        try:
            from jax._src.callback import _callback_op_sharding

            return _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        except ImportError:
            return None

    def on_cpu(ctx, x, *, step, matchers, result):
        if getattr(ctx.module_context.axis_context, "num_devices", 1) > 1:  # over a mesh: the callback,
            # whose sharding XLA keeps (a custom call's maximal sharding it dropped in a nested function:
            # "side-effect HLO must have sharding")
            return elsewhere(ctx, x, step=step, matchers=matchers, result=result)
        import jax

        return jax.ffi.ffi_lowering(f"jaxinfer_constrain_{step}", has_side_effect=True)(
            ctx, x, set=np.int64(matchers.id)
        )

    def elsewhere(ctx, x, *, step, matchers, result):
        out, _, _ = mlir.emit_python_callback(
            ctx,
            lambda x: (getattr(matchers, step)(x),),
            None,
            [x],
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=False,
            sharding=maximal(ctx),
        )
        return out

    mlir.register_lowering(host, elsewhere, cacheable=False)
    mlir.register_lowering(host, on_cpu, platform="cpu", cacheable=False)
    return host


@dataclass(frozen=True)
class HostCall:
    """What the decode programs call on the host (the `Matchers`' `advance` once a step, `check`
    before a verifying pass), and over a mesh where the results go: whole on every device (`whole`,
    a replicated sharding). Left to choose, XLA split the masks by vocabulary as it does the logits,
    and warned on stderr that it had to gather them to do so."""

    matchers: object
    whole: object = None  # a jax.sharding.Sharding over the mesh, or None on one device

    def advance(self, result, x):
        return self._call("advance", result, x)

    def check(self, result, x):
        return self._call("check", result, x)

    def _call(self, step, result, x):
        """The step on the host, inside a traced program: x an int32 device array, the result of
        `result`'s (a jax.ShapeDtypeStruct's) shape. It runs once each time the program reaches it,
        in order with the program's other host calls (it has a side effect)."""
        import jax
        from jax.core import ShapedArray

        result = ShapedArray(result.shape, result.dtype)
        out = _host_primitive().bind(x.astype(np.int32), step=step, matchers=self.matchers, result=result)
        return out if self.whole is None else jax.lax.with_sharding_constraint(out, self.whole)


class Matchers:
    """One llguidance matcher per constrained row, and every row's next-token bitmask [B, W] (int32
    words, bit t % 32 of word t // 32 set where token t is allowed; every bit set in a free row).

    The matchers live in our kernels (kernels/constrain.cc), which the decode programs call each
    step (`advance`, `check`) while the device waits. The host may `start` a row while a step runs
    (a scheduler admits while the last dispatch decodes): such a row makes no token in that step,
    and the step reads nothing of it."""

    def __init__(self, tokenizer, vocab: int, batch: int, eos_ids: tuple[int, ...]):
        self.words = mask_words(vocab)
        self._vocabulary = _vocabulary(tokenizer, vocab, eos_ids)
        self.masks = np.full((batch, self.words), -1, np.int32)  # the kernels write each row's next mask here
        self._kernels = _libraries()[1]
        lens, data = self._vocabulary.lens, self._vocabulary.data  # each token's bytes: JSON rows' keys are guarded
        self.id = self._kernels.jaxinfer_matchers_new(
            batch, self.words, self.masks.ctypes.data, vocab, lens.ctypes.data, data.ctypes.data
        )
        weakref.finalize(self, self._kernels.jaxinfer_matchers_free, self.id)

    def start(self, row: int, constraint: Constraint | None) -> None:
        """Constrain `row` from its next token on (None: free it)."""
        matcher, self.masks[row] = (None, -1) if constraint is None else _matcher(constraint, self._vocabulary)
        json = constraint is not None and constraint.kind in ("json_schema", "json_object")  # no key twice
        self._kernels.jaxinfer_matchers_start(self.id, row, matcher, json)

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed each constrained row the tokens [B, T] it made (the others -1); return the bitmasks
        for the next step [B, W] and, as word W, 1 where the row must end now [B] (its grammar is
        complete, or can go no further: the row's text is what it is)."""
        tokens = np.ascontiguousarray(tokens, np.int32)
        out = np.empty((len(self.masks), self.words + 1), np.int32)
        self._kernels.jaxinfer_matchers_advance(self.id, tokens.ctypes.data, tokens.shape[1], out.ctypes.data)
        return out

    def check(self, drafted: np.ndarray) -> np.ndarray:
        """A verifying pass's drafts [B, K] with how many each row has as column K: for each
        constrained row, the masks of the positions after its first 1..K drafts [B, K, W] (flat)
        and, last, how many of its drafts the grammar takes while staying open [B] (K for a free
        row, or one without drafts). A draft that completes the match is not taken: the pass samples it as the row's own
        token, whose `advance` ends the row, as a plain step would. The matchers are rolled back:
        `advance` feeds what the pass keeps."""
        drafted = np.ascontiguousarray(drafted, np.int32)
        K = drafted.shape[1] - 1
        out = np.empty((len(self.masks), K * self.words + 1), np.int32)
        self._kernels.jaxinfer_matchers_check(self.id, drafted.ctypes.data, K, out.ctypes.data)
        return out

    def complete(self, row: int) -> bool:
        """Whether the row's text so far is a whole match (a JSON value closed, the regex matched)."""
        return self._kernels.jaxinfer_matchers_complete(self.id, row)

    @property
    def steps(self) -> int:
        """How many steps have advanced the matchers (over a mesh: once a step, not once a device)."""
        return self._kernels.jaxinfer_matchers_steps(self.id)


class _Vocabulary:
    """What llguidance reads of our tokenizer (`_LlgTokenizer`): each token's bytes (special tokens
    marked by a leading 0xFF, as llguidance's llama.cpp bridge does), and a tokenize function."""

    def __init__(self, tokenizer, vocab: int):
        self._tok = tokenizer
        special = set(tokenizer.special_ids)
        self.tokens = [(b"\xff" if i in special else b"") + tokenizer.token_bytes(i) for i in range(vocab)]
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self._by_bytes: dict[bytes, int] | None = None  # a piece's id, by its bytes (built when needed)

    def __call__(self, text) -> list[int]:
        """Tokens that spell exactly `text`. A tokenizer that puts a space before the text
        (sentencepiece's dummy prefix, a Metaspace pre-tokenizer: Llama 2, TinyLlama, Mistral v0.1)
        spells " " + text, and llguidance then forced that space inside a match (`--choice yes,no`
        gave "n" then " "): there the first token loses its space (a lone space is dropped, "▁no"
        becomes the piece "no" where the vocabulary has one)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tok.encode(text, add_special_tokens=False)
        spelled = b"".join(self.tokens[i] for i in ids if i < len(self.tokens))
        if not ids or spelled != b" " + text.encode():
            return ids
        first = self.tokens[ids[0]].removeprefix(b" ")
        if not first:
            return ids[1:]
        if self._by_bytes is None:
            self._by_bytes = {piece: i for i, piece in reversed(list(enumerate(self.tokens)))}  # the lowest id
        return [self._by_bytes[first], *ids[1:]] if first in self._by_bytes else ids
