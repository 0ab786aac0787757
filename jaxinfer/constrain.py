"""Constrained decoding: output that matches a JSON schema, any JSON object, a regular expression,
one of a few choices, or a grammar (Lark, or llama.cpp's GBNF), valid by construction.

The grammar-to-token-mask work is llguidance's (Microsoft's, what llama.cpp's `--grammar` build
option, vLLM and SGLang use): an Earley parser over the grammar's lexemes that, given the tokens so
far, gives the set of tokens that can extend them to a valid string, in ~0.1 ms a step here (the
bundled model's 4,096 tokens: 0.15 ms; llguidance measures ~50 µs for 128k-token vocabularies).

How the mask reaches the device: the decode programs call back to the host (`HostCall`) once per
step, after the step's tokens are appended: `Matchers.advance` feeds each constrained row's new
token to its matcher and returns every row's next bitmask, which the next step's sampling applies.
Before a verifying pass (speculation), `Matchers.check` takes the rows' drafts and gives the mask
of each position after them. The loop never leaves the device (no dispatch per token), and only
programs of a state that constrains hold the calls: a job without constraints compiles and runs
exactly as before. A row without a constraint has every bit set, so its tokens are those it makes
alone.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import numpy as np

from jaxinfer.errors import JaxinferError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # a request's
# Compact JSON: llguidance's flexible whitespace lets a small model pad with newlines and spaces
# until the budget runs out (the bundled model, which learned Python, did); one space after ":" and ",".
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: `kind` one of KINDS; `value` a JSON schema (a dict, or its
    text), a regular expression, the choices (a tuple of strings), a grammar's text (Lark or GBNF),
    or None for `json_object`."""

    kind: str
    value: object = None

    def grammar(self) -> str:
        """The llguidance grammar (checked by `check`, not here)."""
        import llguidance

        match self.kind:
            case "json_schema":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            case "choice":
                return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, self.value)))
            case "grammar":  # llama.cpp's GBNF (`root ::= ...`) through llguidance's converter, else Lark
                from llguidance.gbnf_to_lark import any_to_lark

                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.value))
        raise ValueError(self.kind)

    def check(self) -> None:
        """Refuse a constraint that cannot be compiled (before any weights are read)."""
        _compiled(self, None)


def _compiled(constraint: Constraint, tokenizer) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import GbnfToLarkError

    what = constraint.kind.replace("_", " ")
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError, GbnfToLarkError) as e:  # not JSON; a GBNF grammar the converter refuses
        raise JaxinferError(f"the {what} cannot be read: {_first_line(e)}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise JaxinferError(
            f"the {what} cannot be compiled: {_first_line(error)}"
        )  # (not named: its words are llguidance's)
    return grammar


def _first_line(message) -> str:
    """llguidance's message in one line: its first, and the parser's own "error: ..." where it gives one."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    said = [line for line in lines[1:] if line.startswith("error:")][:1]
    return " ".join([lines[0].rstrip(":;"), *(s.removeprefix("error:").strip() for s in said)])[:300]


def from_flags(
    json_schema: str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> Constraint | None:
    """At most one constraint from the values given (a schema's text or a grammar's: already read
    from their files by the caller); None when none is."""
    given = [
        Constraint(kind, value)
        for kind, value, on in (
            ("json_schema", json_schema, json_schema is not None),
            ("json_object", None, json_object),
            ("regex", regex, regex is not None),
            ("choice", tuple(choice or ()), bool(choice)),
            ("grammar", grammar, grammar is not None),
        )
        if on
    ]
    if len(given) > 1:
        raise JaxinferError(
            "give one constraint at most: " + ", ".join(c.kind for c in given), *(c.kind for c in given)
        )
    if given and given[0].kind == "choice" and not all(given[0].value):
        raise JaxinferError("each choice must be non-empty text", "choice")
    if given:
        given[0].check()
    return given[0] if given else None


def from_request(item: dict) -> Constraint | None:
    """The constraint of a request's fields: OpenAI's `response_format` ({"type": "text" |
    "json_object" | "json_schema", "json_schema": {"schema": ...}}) or vLLM's `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar`."""
    found = []
    response_format = item.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise JaxinferError('"response_format" must be {"type": "text" | "json_object" | "json_schema", ...}')
        kind = response_format["type"]
        if kind == "json_object":
            found.append(Constraint("json_object"))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise JaxinferError('"response_format": json_schema needs {"json_schema": {"name", "schema": {...}}}')
            found.append(Constraint("json_schema", inner["schema"]))
    for field, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if field not in item:
            continue
        value = item[field]
        ok = {
            "json_schema": isinstance(value, (dict, str)),
            "regex": isinstance(value, str),
            "choice": isinstance(value, list) and value and all(isinstance(v, str) and v for v in value),
            "grammar": isinstance(value, str),
        }[kind]
        if not ok:
            rule = {
                "json_schema": "a JSON schema",
                "regex": "a string",
                "choice": "a list of non-empty strings",
                "grammar": "a string",
            }
            raise JaxinferError(f'"{field}" must be {rule[kind]}')
        found.append(Constraint(kind, tuple(value) if kind == "choice" else value))
    if len(found) > 1:
        raise JaxinferError("a request takes one constraint at most (response_format or one guided_* field)")
    if found:
        found[0].check()
    return found[0] if found else None


def check_one_process() -> None:
    """Refuse constraints where processes are joined in one mesh (`--coordinator`): the matchers
    live in one process, and the others' programs would wait on calls they cannot make."""
    import jax

    if jax.process_count() > 1:
        raise JaxinferError(
            "constrained output runs in one process: drop the coordinator (or the constraint)", "coordinator"
        )


def mask_words(vocab: int) -> int:
    """int32 words of a row's token mask: a bit per id sampled from."""
    return (vocab + 31) // 32


def check_for(constraint: Constraint, tokenizer, vocab: int, eos_ids: tuple[int, ...]) -> None:
    """Refuse a constraint this model's vocabulary cannot begin to spell (a batch line's, before its
    job admits it: an admission that fails would end the job)."""
    _matcher(constraint, _vocabulary(tokenizer, vocab, eos_ids))


@functools.cache
def _vocabulary(tokenizer, vocab: int, eos_ids: tuple[int, ...]):
    """llguidance's view of our tokenizer (built once: ~50 ms at 49k tokens)."""
    import llguidance

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab)),
        n_vocab=vocab,
        eos_token=[i for i in eos_ids if 0 <= i < vocab] or None,
    )


def _matcher(constraint: Constraint, vocabulary) -> tuple:
    """A fresh matcher for `constraint` and its first mask [W]."""
    import llguidance

    what = constraint.kind.replace("_", " ")
    matcher = llguidance.LLMatcher(vocabulary, _compiled(constraint, vocabulary), log_level=0)
    if matcher.is_error():
        raise JaxinferError(f"the {what}: {_first_line(matcher.get_error())}")
    mask = np.full(mask_words(vocabulary.vocab_size), -1, np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    if not mask.any():
        raise JaxinferError(f"no token of this model's vocabulary can begin the {what}")
    return matcher, mask


@functools.cache
def _host_primitive():
    """A primitive whose lowering calls a Python function with the host's copy of its argument as
    numpy (what XLA hands over) and takes its numpy result back: `jax.experimental.io_callback`
    less its wrapper, which device_puts the arguments into new jax.Arrays under a default-device
    context on every call. That wrapper was half of what a constraint cost a step: the bundled model
    (a 0.45 ms step, this Zen 4, `python scripts/bench_constrained.py`) ×0.60 of a free row
    through io_callback, ×0.78 through this."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    host = Primitive("jaxinfer_on_host")
    host.def_abstract_eval(lambda x, *, fn, result: result)

    def lower(ctx, x, *, fn, result):
        # over a mesh: once, on the first device (a maximal sharding), its result given to all; the
        # choice is io_callback's own, a private function: should a JAX release move it, one device
        # still works (a mesh then fails to compile, saying the call needs a sharding)
        try:
            from jax._src.callback import _callback_op_sharding

            once = _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        except ImportError:
            once = None
        out, _, _ = mlir.emit_python_callback(
            ctx,
            lambda x: (fn(x),),
            None,
            [x],
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=False,
            sharding=once,
        )
        return out

    mlir.register_lowering(host, lower, cacheable=False)
    return host


@dataclass(frozen=True)
class HostCall:
    """What the decode programs call on the host (the `Matchers`' `advance` once a step, `check`
    before a verifying pass: numpy in, numpy out), and over a mesh where the results go: whole on
    every device (`whole`, a replicated sharding). Left to choose, XLA split the masks by
    vocabulary as it does the logits, and warned on stderr that it had to gather them to do so."""

    matchers: object
    whole: object = None  # a jax.sharding.Sharding over the mesh, or None on one device

    def advance(self, result, x):
        return self._call(self.matchers.advance, result, x)

    def check(self, result, x):
        return self._call(self.matchers.check, result, x)

    def _call(self, fn, result, x):
        """`fn(x)` on the host, inside a traced program: x a device array, the result of
        `result`'s (a jax.ShapeDtypeStruct's) shape and dtype. It runs once each time the program
        reaches it, in order with the program's other host calls (it has a side effect)."""
        import jax
        from jax.core import ShapedArray

        out = _host_primitive().bind(x, fn=fn, result=ShapedArray(result.shape, result.dtype))
        return out if self.whole is None else jax.lax.with_sharding_constraint(out, self.whole)


class Matchers:
    """One llguidance matcher per constrained row, and every row's next-token bitmask [B, W] (int32
    words, bit t % 32 of word t // 32 set where token t is allowed; every bit set in a free row).

    `advance` is the decode programs' callback: it runs while the device waits, on XLA's thread,
    and the host changes rows (`start`) only between calls, after their results are back."""

    def __init__(self, tokenizer, vocab: int, batch: int, eos_ids: tuple[int, ...]):
        self.words = mask_words(vocab)
        self._vocabulary = _vocabulary(tokenizer, vocab, eos_ids)
        self._rows: list = [None] * batch
        self._ended = np.zeros(batch, bool)  # the row's grammar is complete: nothing more may follow
        self.masks = np.full((batch, self.words), -1, np.int32)

    def start(self, row: int, constraint: Constraint | None) -> None:
        """Constrain `row` from its next token on (None: free it)."""
        self._rows[row], self._ended[row] = None, False
        self.masks[row] = -1
        if constraint is not None:
            self._rows[row], self.masks[row] = _matcher(constraint, self._vocabulary)

    def _fill(self, row: int) -> None:
        matcher = self._rows[row]
        mask = self.masks[row]
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed each constrained row the tokens [B, T] it made (the others -1); return the bitmasks
        for the next step [B, W] and, as word W, 1 where the row must end now [B] (its grammar is
        complete, or can go no further: the row's text is what it is)."""
        tokens = np.asarray(tokens)  # indexing a jax.Array would dispatch a program
        out = np.zeros((len(self._rows), self.words + 1), np.int32)
        for row, matcher in enumerate(self._rows):
            made = tokens[row][tokens[row] >= 0]
            if matcher is None or not len(made) or self._ended[row]:
                continue
            for token in made:
                if not matcher.consume_token(int(token)):
                    break
            if not (matcher.is_stopped() or matcher.is_error()):
                self._fill(row)
            if matcher.is_stopped() or matcher.is_error() or not self.masks[row].any():
                # ended: its steps are discarded from now on; all bits set keeps their sampling finite
                self._ended[row] = out[row, -1] = True
                self.masks[row] = -1
        out[:, :-1] = self.masks
        return out

    def check(self, drafted: np.ndarray) -> np.ndarray:
        """A verifying pass's drafts [B, K] with how many each row has as column K: for each
        constrained row, the masks of the positions after its first 1..K drafts [B, K, W] (flat)
        and, last, how many of its drafts the grammar takes while staying open [B] (K for a free
        row). A draft that completes the match is not taken: the pass samples it as the row's own
        token, whose `advance` ends the row, as a plain step would. The matchers are rolled back:
        `advance` feeds what the pass keeps."""
        drafted = np.asarray(drafted)
        B, K = drafted.shape[0], drafted.shape[1] - 1
        masks = np.full((B, K, self.words), -1, np.int32)
        taken = np.full(B, K, np.int32)
        for row, matcher in enumerate(self._rows):
            if matcher is None or self._ended[row]:
                continue
            drafts = [int(t) for t in drafted[row, : drafted[row, K]]]
            taken[row] = 0
            for token in drafts[: matcher.validate_tokens(drafts)]:
                matcher.consume_token(token)
                if matcher.is_stopped():
                    matcher.rollback(1)
                    break
                matcher.unsafe_compute_mask_ptr(masks[row, taken[row]].ctypes.data, masks[row, 0].nbytes)
                taken[row] += 1
            matcher.rollback(int(taken[row]))
        return np.concatenate([masks.reshape(B, -1), taken[:, None]], axis=1)

    def complete(self, row: int) -> bool:
        """Whether the row's text so far is a whole match (a JSON value closed, the regex matched)."""
        matcher = self._rows[row]
        return matcher is None or (not matcher.is_error() and matcher.is_accepting())


class _Vocabulary:
    """Our tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes (special
    tokens marked by a leading 0xFF, as llguidance's llama.cpp bridge does), and a tokenize function."""

    def __init__(self, tokenizer, vocab: int):
        self._tok = tokenizer
        special = set(tokenizer.special_ids)
        self.tokens = [(b"\xff" if i in special else b"") + tokenizer.token_bytes(i) for i in range(vocab)]
        self.special_token_ids = sorted(i for i in special if i < vocab)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.bos_token_id = tokenizer.bos_id
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
