"""The two compiled phases over one documented loop state.

`prefill` runs the (bucket-padded) prompt, or its part the cache does not hold yet, in one pass and
samples the first token: compute-bound, it sets TTFT. `decode` is a `lax.while_loop` of single-token steps, each re-reading every weight and
the first `kv_len` cache positions (a power-of-two bucket covering the longest live row, chosen by
`jaxinfer.slots`): bandwidth-bound, it sets the inter-token latency. Both take the state donated and
return it, so the cache is updated in place. The decode loop runs at most `steps` iterations, a traced
value: the host picks the chunk length (for live streaming and prompt Ctrl-C) without recompiling,
and one call with `steps = max_tokens` is the whole request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

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
    ignore_eos: jax.Array  # [B] bool: the row runs to its limit whatever it samples (benchmarks)
    sampler: SamplerArrays  # [B] per field
    eos: jax.Array  # [E] int32: ids that end a row


def initial_state(cfg: ModelConfig, params: model.Params, batch: int, max_context: int, eos_ids: tuple[int, ...]) -> DecodeState:
    """An empty state: zero cache in the weights' dtype, every row done."""
    return DecodeState(
        cache=KVCache.zeros(cfg, batch, max_context, model.compute_dtype(params)),
        tokens=jnp.zeros((batch, max_context), jnp.int32),
        length=jnp.zeros((batch,), jnp.int32),
        limit=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        seen=jnp.zeros((batch, cfg.vocab_size), bool),
        seeds=jnp.zeros((batch,), jnp.int32),
        ignore_eos=jnp.zeros((batch,), bool),
        sampler=SamplerArrays.from_settings([Sampling()] * batch),
        eos=jnp.asarray(eos_ids or (-1,), jnp.int32),
    )


def admission(
    rows: list[int], prompts: list[list[int]], starts: list[int], ends: list[int], limits: list[int], seeds: list[int],
    samplings: list[Sampling], ignore_eos: list[bool], bucket: int,
) -> tuple:
    """`prefill`'s arguments after the state: each row's prompt tokens `start:end`, padded to
    `bucket`; the chunk is final where `end` is the prompt's end. Host values go over with one
    device_put (jnp.asarray would compile a conversion program per call)."""
    chunk = np.zeros((len(rows), bucket), np.int32)
    for i, (prompt, start, end) in enumerate(zip(prompts, starts, ends)):
        chunk[i, : end - start] = prompt[start:end]
    lengths = [end - start for start, end in zip(starts, ends)]
    final = [end == len(prompt) for prompt, end in zip(prompts, ends)]
    host = tuple(np.asarray(x, np.int32) for x in (rows, chunk, starts, lengths)) + (np.asarray(final, bool),)
    seeds = np.asarray([seed % 2**32 for seed in seeds], np.uint32).view(np.int32)  # any integer: its low 32 bits
    host += (np.asarray(limits, np.int32), seeds, np.asarray(ignore_eos, bool))
    return jax.device_put(host) + (SamplerArrays.from_settings(samplings),)


def _sample_at(
    seeds: jax.Array, seen: jax.Array, sampler: SamplerArrays, logits: jax.Array, position: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """One token per row, among the ids the tokenizer has. Keys come from the row's own seed and
    position only: a result never depends on chunking, on other rows, or on which slot it occupies."""
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(seeds, position)
    n = cfg.sampled_vocab or cfg.vocab_size
    return sample(logits[:, :n], seen[:, :n], keys, sampler)


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
        done=state.done | (active & ((jnp.isin(token, state.eos) & ~state.ignore_eos) | (length >= state.limit))),
        seen=state.seen.at[rows, token].max(active),
    )


@partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("state",))
def prefill(
    params: model.Params,
    state: DecodeState,
    rows: jax.Array,
    chunk: jax.Array,
    start: jax.Array,
    chunk_len: jax.Array,
    final: jax.Array,
    limit: jax.Array,
    seeds: jax.Array,
    ignore_eos: jax.Array,
    sampler: SamplerArrays,
    cfg: ModelConfig,
    kv_len: int,
) -> DecodeState:
    """Start sequences in rows `rows` [R] of the state: prefill their prompt tokens from position
    `start` [R] on (chunk [R, T], padded to a bucket; true lengths [R]) on top of the first `start`
    cached positions, set their budget (`limit`), seed, EOS rule and sampling, and sample each one's first
    new token. Other rows are untouched: a batch admits a request into a free slot while the rest
    keep their place.

    `start` is 0 for a fresh prompt, or the length of a prefix whose K/V the row already holds (a
    chat's earlier turns, or a long prompt's earlier chunks). A row whose chunk is not `final` [R]
    samples nothing and stays done, so decode passes it by; its next chunk starts at its `length`.
    `kv_len` (static) covers start + T, so attention reads no further.
    """
    R, T = chunk.shape
    B, S = state.tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [R, T]
    hidden, cache = model.forward(params, cfg, chunk, positions, state.cache, kv_len, rows)
    last = jnp.take_along_axis(hidden, (chunk_len - 1)[:, None, None], axis=1)[:, 0]  # [R, D]
    length = start + chunk_len  # [R]
    tokens = state.tokens.at[rows[:, None], positions].set(chunk, mode="drop")  # padding lands past `length`
    in_sequence = jnp.arange(S)[None, :] < length[:, None]  # [R, S]
    seen = jnp.zeros((R, cfg.vocab_size), bool).at[jnp.arange(R)[:, None], tokens[rows]].max(in_sequence)
    state = replace(
        state,
        cache=cache,
        tokens=tokens,
        length=state.length.at[rows].set(length),
        limit=state.limit.at[rows].set(limit),
        done=state.done.at[rows].set(~final),
        seen=state.seen.at[rows].set(seen),
        seeds=state.seeds.at[rows].set(seeds),
        ignore_eos=state.ignore_eos.at[rows].set(ignore_eos),
        sampler=jax.tree.map(lambda all_rows, new: all_rows.at[rows].set(new), state.sampler, sampler),
    )
    token = _sample_at(seeds, seen, sampler, model.logits(params, last), length, cfg)
    started = jnp.zeros(B, bool).at[rows].set(final)
    return _append(state, jnp.zeros(B, jnp.int32).at[rows].set(token), started)


def decode_step(params: model.Params, state: DecodeState, cfg: ModelConfig, kv_len: int) -> DecodeState:
    """Feed each live row's last token, sample the next, attending over the first `kv_len` cache
    positions (every live row's last token must sit below it)."""
    active = ~state.done
    S = state.tokens.shape[1]
    position = state.length - 1  # [B]: where the last token sits
    last = jnp.take_along_axis(state.tokens, position[:, None], axis=1)  # [B, 1]
    write_at = jnp.where(active, position, S)[:, None]  # finished rows write nothing
    hidden, cache = model.forward(params, cfg, last, write_at, state.cache, kv_len)
    state = replace(state, cache=cache)
    token = _sample_at(state.seeds, state.seen, state.sampler, model.logits(params, hidden[:, 0]), state.length, cfg)
    return _append(state, token, active)


@partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("state",))
def decode(
    params: model.Params, state: DecodeState, steps: jax.Array, stop_on_finish: jax.Array, cfg: ModelConfig, kv_len: int
) -> DecodeState:
    """Up to `steps` decode steps, ending early once every row is done, or (`stop_on_finish`, a
    traced flag) as soon as any row finishes, so a batch can hand its slot to a waiting request.
    The caller keeps every live row inside `kv_len` for all `steps` (it caps `steps`)."""
    running = ~state.done

    def cond(carry):
        i, s = carry
        finished = jnp.any(running & s.done) & stop_on_finish
        return (i < steps) & ~jnp.all(s.done) & ~finished

    def body(carry):
        i, s = carry
        return i + 1, decode_step(params, s, cfg, kv_len)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


@partial(jax.jit, donate_argnames=("state",))
def retire(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Mark rows [B] bool as done (their text hit a stop string): the loop stops spending on them."""
    return replace(state, done=state.done | rows)
