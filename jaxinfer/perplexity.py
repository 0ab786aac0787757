"""Token-level perplexity of a text over sliding windows, as transformers' perplexity recipe and
llama.cpp's `llama-perplexity` measure it: how a user judges a quantization.

The text is tokenized once. Windows of `context` tokens advance by `stride`; each window scores only
the tokens the previous one did not, each seeing up to `context - 1` tokens before it. Every window
runs through one compiled program (the last is padded), the training-style forward over the window
(no cache). Given a reference model (the same weights unquantized), each window also runs through
it and the KL divergence of our next-token distribution from the reference's is averaged over the
scored tokens, with how often the two agree on the most likely token (greedy agreement with the
prefix held fixed, so one early difference does not count twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import model
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import TOP_LOGPROBS


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the text
    scored_from: int  # tokens of the window before this one only give context


def windows(tokens: int, context: int, stride: int) -> list[Window]:
    """Windows over `tokens` tokens, each scoring the positions after the previous one's end (each
    scores at least one: `context` ≥ 2, `stride` ≥ 1)."""
    if context < 2 or stride < 1:
        raise ValueError(f"windows of {context} tokens advancing by {stride} would never reach the end")
    out, end = [], 1  # the first token has nothing to predict it
    while end < tokens:
        # a window keeps at least one token before those it scores: they need a predecessor
        stop = min(end + min(stride, context - 1), tokens) if out else min(context, tokens)
        start = max(0, stop - context)
        out.append(Window(start, end - start))
        end = stop
    return out


def _next_token_logprobs(params: dict, tokens: jax.Array, cfg: ModelConfig, rope_len=None) -> jax.Array:
    """Log-probabilities [T-1, V] of each next token of `tokens` [T] from position 0, over the ids
    the tokenizer has (as sampling); `rope_len` as `model.forward`'s."""
    T = tokens.shape[0]
    hidden, _ = model.forward(params, cfg, tokens[None, :-1], jnp.arange(T - 1)[None], None, T - 1, rope_len=rope_len)
    return jax.nn.log_softmax(model.logits(params, hidden[0], cfg)[:, : cfg.sampled_ids], -1)


@partial(jax.jit, static_argnames=("cfg",))
def _window_logprobs(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`_next_token_logprobs` of one window [T]."""
    return _next_token_logprobs(params, tokens, cfg)


@partial(jax.jit, static_argnames=("cfg",))
def _prompt_top(
    params: dict, tokens: jax.Array, length: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of each token of `tokens` [T] (the first `length` real, the rest padding) after the first:
    its log-probability [T-1] given those before it, and the TOP_LOGPROBS most likely ids there
    [T-1, N] with theirs. longrope picks its factors by the real length."""
    scores = _next_token_logprobs(params, tokens, cfg, rope_len=jnp.full((1, 1), length, jnp.int32))
    chosen = jnp.take_along_axis(scores, tokens[1:, None], -1)[:, 0]
    top, ids = jax.lax.top_k(scores, min(TOP_LOGPROBS, scores.shape[-1]))
    return chosen, ids, top


def prompt_logprobs(cfg: ModelConfig, params: dict, ids: list[int]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Each prompt token after the first: (its log-probability, the TOP_LOGPROBS most likely ids at
    its position, theirs), under the model's own distribution (its logits' softmax: no temperature,
    penalty or constraint, as `perplexity` scores a text, and as OpenAI's `echo` and vLLM's
    `prompt_logprobs` give them). One pass over the prompt padded to a power of two (after the
    tokens: a causal model's earlier positions never see it), so prompts share few programs."""
    padded = np.zeros(max(16, 1 << (len(ids) - 1).bit_length()), np.int32)
    padded[: len(ids)] = ids
    chosen, top_ids, top = jax.device_get(_prompt_top(params, jnp.asarray(padded), np.int32(len(ids)), cfg))
    return [(float(chosen[t]), top_ids[t], top[t]) for t in range(len(ids) - 1)]


@jax.jit
def _score(logprobs: jax.Array, reference: jax.Array | None, targets: jax.Array, scored: jax.Array) -> dict:
    """Sums over the scored positions: negative log-likelihood, and against a reference the KL
    divergence KL(reference ‖ ours) and top-1 agreement."""
    nll = -jnp.take_along_axis(logprobs, targets[:, None], -1)[:, 0]
    sums = {"nll": jnp.sum(jnp.where(scored, nll, 0.0))}
    if reference is not None:
        p = jnp.exp(reference)
        kl = jnp.sum(p * (reference - logprobs), -1)
        agree = jnp.argmax(logprobs, -1) == jnp.argmax(reference, -1)
        sums |= {"kl": jnp.sum(jnp.where(scored, kl, 0.0)), "agree": jnp.sum(scored & agree)}
    return sums


def perplexity(
    cfg: ModelConfig,
    params: dict,
    ids: list[int],
    context: int,
    stride: int | None = None,
    reference: tuple[ModelConfig, dict] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Perplexity of `ids` under the model; `reference`: (config, parameters) of the same model at
    full precision, to compare against. `stride` defaults to half the context."""
    if len(ids) < 2:
        raise JaxinferError("the text is too short: perplexity needs at least 2 tokens")
    if context < 2:  # a window scores the tokens after its first: one token scores none, and never advances
        raise JaxinferError("max_context must be at least 2 for perplexity: a token and the next", "max_context")
    context = min(context, len(ids))
    stride = stride or max(1, context // 2)
    if not 1 <= stride <= context:
        raise JaxinferError(f"stride must be between 1 and the context ({context})", "stride")
    text = np.asarray(ids, np.int32)
    totals: dict[str, float] = {}
    plan = windows(len(ids), context, stride)
    for done, window in enumerate(plan, 1):
        chunk = np.zeros(context, np.int32)
        piece = text[window.start : window.start + context]
        chunk[: len(piece)] = piece
        position = np.arange(context - 1)  # predicting token position + 1
        scored = (position + 1 >= window.scored_from) & (position + 1 < len(piece))
        ours = _window_logprobs(params, jnp.asarray(chunk), cfg)
        theirs = _window_logprobs(reference[1], jnp.asarray(chunk), reference[0]) if reference is not None else None
        sums = jax.device_get(_score(ours, theirs, jnp.asarray(chunk[1:]), jnp.asarray(scored)))
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        if progress:
            progress(done, len(plan))
    tokens = len(ids) - 1
    nll = totals["nll"] / tokens
    result = {
        "perplexity": math.exp(nll),
        "nll": nll,
        "tokens": tokens,
        "windows": len(plan),
        "context": context,
        "stride": stride,
    }
    if reference is not None:
        result |= {"kl_divergence": totals["kl"] / tokens, "top1_agreement": totals["agree"] / tokens}
    return result
