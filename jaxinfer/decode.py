"""The two compiled phases over one documented loop state.

`prefill` runs the (bucket-padded) prompt, or its part the cache does not hold yet, in one pass and
samples the first token: compute-bound, it sets TTFT. `decode` is a `lax.while_loop` of single-token steps, each re-reading every weight and
the whole cache: bandwidth-bound, it sets the inter-token latency. Both take the state donated and
return it, so the cache is updated in place. The decode loop runs at most `steps` iterations, a traced
value: the host picks the chunk length (for live streaming and prompt Ctrl-C) without recompiling,
and one call with `steps = max_tokens` is the whole request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer import model
from jaxinfer.config import ModelConfig
from jaxinfer.kvcache import KVCache
from jaxinfer.sampling import SamplerArrays, Sampling, sample


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    cache: KVCache
    tokens: jax.Array  # [B, S] int32: every token by position, prompt then generated
    length: jax.Array  # [B] int32: tokens so far; the next one is sampled for position `length`
    limit: jax.Array  # [B] int32: a row stops when `length` reaches it (prompt + max tokens, ≤ S)
    done: jax.Array  # [B] bool
    seen: jax.Array  # [B, V] bool: tokens present so far, for the repetition penalty
    seeds: jax.Array  # [B] int32: a row's token at position p is drawn with fold_in(key(seed), p)
    sampler: SamplerArrays  # [B] per field
    eos: jax.Array  # [E] int32: ids that end a row


def initial_state(cfg: ModelConfig, params: model.Params, batch: int, max_context: int, eos_ids: tuple[int, ...]) -> DecodeState:
    """An empty state: zero cache in the weights' dtype, every row done."""
    return DecodeState(
        cache=KVCache.zeros(cfg, batch, max_context, jax.tree.leaves(params)[0].dtype),
        tokens=jnp.zeros((batch, max_context), jnp.int32),
        length=jnp.zeros((batch,), jnp.int32),
        limit=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        seen=jnp.zeros((batch, cfg.vocab_size), bool),
        seeds=jnp.zeros((batch,), jnp.int32),
        sampler=SamplerArrays.from_settings([Sampling()] * batch),
        eos=jnp.asarray(eos_ids or (-1,), jnp.int32),
    )


def _sample_at(state: DecodeState, logits: jax.Array, position: jax.Array) -> jax.Array:
    """Per-row keys from the row's own seed and position only: a result never depends on chunking
    or on other rows."""
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(state.seeds, position)
    return sample(logits, state.seen, keys, state.sampler)


def _append(state: DecodeState, token: jax.Array, active: jax.Array) -> DecodeState:
    """Write token [B] at each active row's `length` and advance it."""
    rows = jnp.arange(token.shape[0])
    S = state.tokens.shape[1]
    at = jnp.where(active, state.length, S)  # S: out of range, so the write is dropped
    length = state.length + active
    return replace(
        state,
        tokens=state.tokens.at[rows, at].set(token, mode="drop"),
        length=length,
        done=state.done | (active & (jnp.isin(token, state.eos) | (length >= state.limit))),
        seen=state.seen.at[rows, token].max(active),
    )


@partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("state",))
def prefill(
    params: model.Params,
    state: DecodeState,
    chunk: jax.Array,
    start: jax.Array,
    chunk_len: jax.Array,
    cfg: ModelConfig,
    kv_len: int,
) -> DecodeState:
    """Prefill the prompt's tokens from position `start` [B] on (chunk [B, T], padded to a bucket;
    true lengths [B]) on top of the first `start` cached positions, and sample the first new token.

    `start` is 0 for a fresh prompt, or the length of a prefix whose K/V the cache already holds (a
    chat's earlier turns). `kv_len` (static) covers start + T, so attention reads no further.
    """
    B, T = chunk.shape
    rows = jnp.arange(B)[:, None]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    hidden, cache = model.forward(params, cfg, chunk, positions, state.cache, kv_len)
    last = jnp.take_along_axis(hidden, (chunk_len - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    length = start + chunk_len
    tokens = state.tokens.at[rows, positions].set(chunk, mode="drop")  # padding lands past `length`
    in_sequence = jnp.arange(tokens.shape[1])[None, :] < length[:, None]  # [B, S]
    state = replace(
        state,
        cache=cache,
        tokens=tokens,
        length=length,
        done=jnp.zeros_like(state.done),
        seen=jnp.zeros_like(state.seen).at[rows, tokens].max(in_sequence),
    )
    token = _sample_at(state, model.logits(params, last), length)
    return _append(state, token, jnp.ones_like(state.done))


def decode_step(params: model.Params, state: DecodeState, cfg: ModelConfig) -> DecodeState:
    """Feed each live row's last token, sample the next."""
    active = ~state.done
    S = state.tokens.shape[1]
    position = state.length - 1  # [B]: where the last token sits
    last = jnp.take_along_axis(state.tokens, position[:, None], axis=1)  # [B, 1]
    write_at = jnp.where(active, position, S)[:, None]  # finished rows write nothing
    hidden, cache = model.forward(params, cfg, last, write_at, state.cache, S)
    state = replace(state, cache=cache)
    token = _sample_at(state, model.logits(params, hidden[:, 0]), state.length)
    return _append(state, token, active)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def decode(params: model.Params, state: DecodeState, steps: jax.Array, cfg: ModelConfig) -> DecodeState:
    """Up to `steps` decode steps, ending early once every row is done."""

    def cond(carry):
        i, s = carry
        return (i < steps) & ~jnp.all(s.done)

    def body(carry):
        i, s = carry
        return i + 1, decode_step(params, s, cfg)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
