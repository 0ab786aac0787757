"""The two compiled phases over one documented loop state.

`prefill` runs the (bucket-padded) prompt, or its part the cache does not hold yet, in one pass and
samples the first token: compute-bound, it sets TTFT. `decode` is a `lax.while_loop` of single-token
steps, each re-reading every weight and the first `kv_len` cache positions (a power-of-two bucket
covering the longest live row, chosen by `jaxinfer.slots`): bandwidth-bound, it sets the inter-token
latency. Both take the state donated and return it, so the cache is updated in place. The decode loop
runs at most `steps` iterations, a traced value: the host picks the chunk length (for live streaming and
prompt Ctrl-C) without recompiling, and one call with `steps = max_tokens` is the whole request.

With `Speculation(draft=K)`, a decode step of the rows that ask for it drafts up to K tokens by
prompt lookup (the tokens that followed the latest earlier occurrence of the row's last n tokens,
already in the state), or with `Speculation(draft=K, model=cfg)` by K steps of a small draft
model with the same tokenizer (its own cache in the state), and verifies them in one pass over the
weights: K+1 positions for about the bandwidth of one. Each position's token is sampled exactly as
plain decoding samples it (same logits rule, same key `fold_in(seed, position)`), and drafts are
kept while they equal it, so the output is the plain output, greedy or sampled. For a draft that
is one token, not a distribution, this is the speculative-sampling rule of Leviathan et al. (accept
d with probability p(d), else draw from p without d); a draft model's tokens are drawn with the
same keys, so they are kept about as often as that rule would keep them (`sampling._gumbel_max`).
A step where no row found a draft is the plain one-token step.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer import model
from jaxinfer.config import ModelConfig, longrope_switch
from jaxinfer.kvcache import KVCache
from jaxinfer.sampling import Guards, Penalties, SamplerArrays, logprobs, sample
from jaxinfer.state import DecodeState, Logprobs, Speculation

MAX_BACKOFF = 64  # steps a row with failing drafts waits at most before drafting again
# Drafts a verifying pass must keep to beat plain steps: it costs about two of them (measured:
# 1.6-2.2× on XLA CPU, the bundled model and the SmolLM-135M shape in float32), and makes 1 + accepted.
PAYING_DRAFTS = 2


def _sample_at(
    seeds: jax.Array,
    seen: jax.Array,
    sampler: SamplerArrays,
    logits: jax.Array,
    position: jax.Array,
    cfg: ModelConfig,
    record: bool = False,
    allowed: jax.Array | None = None,
    penalties: Penalties | None = None,
    guards: Guards | None = None,
    eos: jax.Array | None = None,
) -> tuple[jax.Array, tuple | None]:
    """One token per row, among the ids the tokenizer has (and its mask `allowed` [B, W] lets it
    take), after its logit bias and presence/frequency penalties where the state has them, its
    `guards` (no `eos` id below its floor, a thinking block's forced end), and
    (`record`) its log-probabilities (`sampling.logprobs`: chosen [B], ids [B, N], top [B, N]; a
    masked row's over the tokens it may take), else None. Keys come from the row's own seed and
    position only: a result never depends on chunking, on other rows, or on which slot it occupies."""
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(seeds, position)
    n = cfg.sampled_ids
    logits = logits[:, :n]
    if penalties is not None:
        logits = penalties.apply(logits, sampler)
    if guards is not None:
        logits = guards.apply(logits, position, eos)
    if allowed is not None:
        bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
        logits = jnp.where(bits.reshape(bits.shape[0], -1)[:, :n] > 0, logits, -jnp.inf)
    token = sample(logits, seen[:, :n], keys, sampler)
    return token, logprobs(logits, seen[:, :n], sampler, token) if record else None


def _append(
    state: DecodeState, tokens: jax.Array, offered: jax.Array, lp: tuple | None = None, constrain=None
) -> tuple[DecodeState, jax.Array]:
    """Write tokens [B, T] from each row's `length` on, those `offered` [B, T] (a prefix per row)
    up to the first that ends the row (an EOS id, or its budget reached), with their
    log-probabilities `lp` (chosen [B, T], ids and top [B, T, N]) where the state records them.
    Where rows are constrained, `constrain` (`matchers.HostCall`: its matchers, on the host) take the
    tokens made and gives the next masks, and the rows whose grammar is complete end.
    Returns the state and how many tokens each row took [B]. One write per array whatever T (a
    verifying pass's K+1 tokens): per-op costs weigh on a small model's step."""
    B, T = tokens.shape
    j = jnp.arange(T)
    ends = (jnp.isin(tokens, state.eos) & ~state.ignore_eos[:, None]) | (
        state.length[:, None] + j + 1 >= state.limit[:, None]
    )
    made = offered & (jnp.cumsum(ends, axis=1) - ends == 0)  # [B, T]
    rows = jnp.arange(B)[:, None]
    at = jnp.where(made, state.length[:, None] + j, state.tokens.shape[1])  # past the buffer: the write is dropped
    if state.logprobs is not None:
        state = replace(
            state,
            logprobs=Logprobs(
                *(x.at[rows, at].set(new, mode="drop") for x, new in zip(vars(state.logprobs).values(), lp))
            ),
        )
    state = replace(
        state,
        tokens=state.tokens.at[rows, at].set(tokens, mode="drop"),
        length=state.length + made.sum(1),
        done=state.done | jnp.any(made & ends, axis=1),
        seen=state.seen.at[rows, tokens].max(made),
    )
    if state.penalties is not None:
        counts = state.penalties.counts.at[rows, tokens].add(made.astype(jnp.int32))
        state = replace(state, penalties=replace(state.penalties, counts=counts))
    if state.guards is not None:
        state = replace(state, guards=state.guards.advance(state.tokens, state.length, made.sum(1)))
    if constrain is not None:  # one array each way: each costs the callback a conversion
        W = state.allowed.shape[1]
        fed = constrain.advance(jax.ShapeDtypeStruct((B, W + 1), jnp.int32), jnp.where(made, tokens, -1))
        state = replace(state, allowed=fed[:, :W], done=state.done | (fed[:, W] != 0))
    return state, made.sum(1)


@partial(
    jax.jit, static_argnames=("cfg", "kv_len", "spec", "step_kv_len", "fresh", "constrain"), donate_argnames=("state",)
)
def prefill(
    params: model.Params,
    state: DecodeState,
    rows: jax.Array,
    chunk: jax.Array,
    start: jax.Array,
    chunk_len: jax.Array,
    final: jax.Array,
    marked: jax.Array,
    prompt_len: jax.Array,
    limit: jax.Array,
    seeds: jax.Array,
    ignore_eos: jax.Array,
    speculate: jax.Array,
    sampler: SamplerArrays,
    allowed: jax.Array | None = None,
    bias: jax.Array | None = None,
    guards: tuple[jax.Array, ...] | None = None,
    draft_params: model.Params | None = None,
    *,
    cfg: ModelConfig,
    kv_len: int,
    spec: Speculation = Speculation(),
    step_kv_len: int = 0,
    fresh: bool = False,
    constrain=None,
) -> DecodeState:
    """Start sequences in rows `rows` [R] of the state: prefill their prompt tokens from position
    `start` [R] on (chunk [R, T], padded to a bucket; true lengths [R]) on top of the first `start`
    cached positions, set their budget (`limit`), seed, EOS rule, speculation and sampling, and sample each one's first
    new token. Other rows are untouched: a batch admits a request into a free slot while the rest
    keep their place.

    `start` is 0 for a fresh prompt, or the length of a prefix whose K/V the row already holds (a
    chat's earlier turns, or a long prompt's earlier chunks). A row whose chunk is not `final` [R]
    samples nothing and stays done, so decode passes it by; its next chunk starts at its `length`.
    A hybrid's row keeps its state where its prompt is in, and where the chunk is `marked` [R]
    (it ends at the row's mark: `DeltaState.keep`).
    `kv_len` (static) covers start + T, so attention reads no further. `prompt_len` [R]: the whole
    prompt's length, by which longrope picks its factors for every chunk of it. `fresh` (static):
    every `start` is 0, so the chunk attends only to itself (`model.flash`).

    With `step_kv_len` (static, the decode bucket), the same pass also takes one plain decode step
    of every live row (`decode_step`'s, attending over that many positions): the chunk and the
    running rows' token share one read of the weights (Sarathi's piggybacking).

    Where rows are constrained, `allowed` [R, W] masks the new rows' first token and `constrain`
    (static) is the host's callback (`_append`). Where the state is penalized, `bias` [R, V] is the
    new rows' logit bias (their counts start at zero); where it is guarded, `guards` their (floor,
    budget, left) [R] each.
    """
    R, T = chunk.shape
    B, S = state.tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [R, T]
    live = jnp.arange(T)[None, :] < chunk_len[:, None]  # the bucket's padding moves no recurrent state
    blocks = [model.Block(chunk, positions, kv_len, rows, prompt_len[:, None], fresh, live)]
    active = _steps(state, cfg) if step_kv_len else jnp.zeros(B, bool)  # decided before the new rows join
    if step_kv_len:
        blocks.append(model.Block(*_feed(state, 1, 1), step_kv_len))
    hidden, cache = model.forward_blocks(params, cfg, blocks, state.cache)
    if cfg.recurrent:
        cache = replace(cache, delta=cache.delta.keep(rows, prompt=final, mark=marked))
    if spec.model:  # the draft's cache: the chunk, and the token before each running row's last (as `decode_step`)
        # all but a prompt's last token: the draft lags the row by two (`model_drafts`), so the
        # first step feeds it that one (a recurrent state would take it twice)
        short = live & ~(final[:, None] & (jnp.arange(T)[None, :] == chunk_len[:, None] - 1))
        drafted = [replace(blocks[0], rope_len=None, live=short)]
        if step_kv_len:
            drafted.append(model.Block(*_feed(state, 2, 1), step_kv_len))
        draft_cache = model.forward_blocks(draft_params, spec.model, drafted, state.draft_cache)[1]
        if spec.model.recurrent:  # a mark's chunk is never final: the draft has all of it
            draft_cache = replace(draft_cache, delta=draft_cache.delta.keep(rows, prompt=final, mark=marked))
        state = replace(state, draft_cache=draft_cache)
    last = jnp.take_along_axis(hidden[0], (chunk_len - 1)[:, None, None], axis=1)[:, 0]  # [R, D]
    # One pass over the LM head for the chunks' last tokens and the running rows'.
    logits = model.logits(params, jnp.concatenate([last] + [h[:, 0] for h in hidden[1:]]), cfg)  # [R (+ B), V]
    record = state.logprobs is not None
    if step_kv_len:
        stepped, stepped_lp = _sample_at(
            state.seeds,
            state.seen,
            state.sampler,
            logits[R:],
            state.length,
            cfg,
            record,
            state.allowed,
            state.penalties,
            state.guards,
            state.eos,
        )
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
        speculate=state.speculate.at[rows].set(speculate),
        drafted=state.drafted.at[rows].set(0),
        accepted=state.accepted.at[rows].set(0),
        passes=state.passes.at[rows].set(0) + active,
        # a step counts one down, as `decode_step`
        backoff=jnp.maximum(state.backoff.at[rows].set(0) - bool(step_kv_len), 0),
        patience=state.patience.at[rows].set(0),
        sampler=jax.tree.map(lambda all_rows, new: all_rows.at[rows].set(new), state.sampler, sampler),
    )
    penalties = None
    if state.penalties is not None:
        penalties = Penalties(bias, jnp.zeros_like(bias, jnp.int32))
        state = replace(state, penalties=jax.tree.map(lambda a, new: a.at[rows].set(new), state.penalties, penalties))
    new_guards = None
    if state.guards is not None:
        given = dict(zip(Guards.ROWS, guards))
        new_guards = state.guards.per_row(lambda name, _: given[name])
        state = replace(state, guards=state.guards.per_row(lambda name, a: a.at[rows].set(given[name])))
    first, first_lp = _sample_at(
        seeds, seen, sampler, logits[:R], length, cfg, record, allowed, penalties, new_guards, state.eos
    )
    started = jnp.zeros(B, bool).at[rows].set(final)
    token = jnp.zeros(B, jnp.int32).at[rows].set(first)
    lp = first_lp and tuple(jnp.zeros((B, *x.shape[1:]), x.dtype).at[rows].set(x) for x in first_lp)
    if step_kv_len:  # the running rows' tokens (no row both starts and steps: a prefilling row is done)
        token = jnp.where(active, stepped, token)
        lp = lp and tuple(jnp.where(active.reshape(-1, *[1] * (x.ndim - 1)), s, x) for x, s in zip(lp, stepped_lp))
    lp = lp and tuple(x[:, None] for x in lp)
    return _append(state, token[:, None], (started | active)[:, None], lp, constrain)[0]


@partial(jax.jit, static_argnames=("spec", "kv_len"), donate_argnames=("state",))
def catch_up(
    params: model.Params,
    state: DecodeState,
    rows: jax.Array,
    start: jax.Array,
    draft_params: model.Params,
    *,
    spec: Speculation,
    kv_len: int,
) -> DecodeState:
    """Rows `rows` [R] that will be prefilled from `start` [R] > 0 (the first `start` tokens taken
    from a cache: a chat's earlier turns, another row's): the draft model takes the token at
    `start` - 1, which a held row's draft lacks (it lags the row by two, the target by one), so its
    cache and state are the target's. A recurrent draft's state cannot skip it."""
    del params  # the programs' shared signature (`Slots._program`)
    at = (start - 1)[:, None]
    block = model.Block(jnp.take_along_axis(state.tokens[rows], at, axis=1), at, kv_len, rows)
    return replace(state, draft_cache=model.forward_blocks(draft_params, spec.model, [block], state.draft_cache)[1])


def _steps(state: DecodeState, cfg: ModelConfig) -> jax.Array:
    """[B] bool: the rows a decode step advances: live, and (longrope) not at the switch, where
    `jaxinfer.slots` prefills the row again with the long factors."""
    active = ~state.done
    if switch := longrope_switch(cfg):
        active &= state.length != switch + 1
    return active


def _feed(state: DecodeState, back: int, count: int) -> tuple[jax.Array, jax.Array]:
    """Each row's `count` tokens from `back` before its length on: tokens [B, count] and where live
    rows write them [B, count] (finished rows: past the cache, so they write nothing)."""
    positions = state.length[:, None] - back + jnp.arange(count)
    tokens = jnp.take_along_axis(state.tokens, positions, axis=1)
    return tokens, jnp.where(~state.done[:, None], positions, state.tokens.shape[1])


def decode_step(
    params: model.Params,
    state: DecodeState,
    cfg: ModelConfig,
    kv_len: int,
    spec: Speculation = Speculation(),
    draft_params=None,
    constrain=None,
) -> DecodeState:
    """Feed each live row's last token, sample the next, attending over the first `kv_len` cache
    positions (every live row's last token must sit below it). A draft model takes the token before
    it, so its cache keeps up with all but the row's last two tokens."""
    active = ~state.done
    if spec.model:
        state = replace(
            state,
            draft_cache=model.forward(draft_params, spec.model, *_feed(state, 2, 1), state.draft_cache, kv_len)[1],
        )
    last, write_at = _feed(state, 1, 1)  # [B, 1]
    hidden, cache = model.forward(params, cfg, last, write_at, state.cache, kv_len)
    state = replace(state, cache=cache, passes=state.passes + active, backoff=jnp.maximum(state.backoff - 1, 0))
    token, lp = _sample_at(
        state.seeds,
        state.seen,
        state.sampler,
        model.logits(params, hidden[:, 0], cfg),
        state.length,
        cfg,
        state.logprobs is not None,
        state.allowed,
        state.penalties,
        state.guards,
        state.eos,
    )
    return _append(state, token[:, None], active[:, None], lp and tuple(x[:, None] for x in lp), constrain)[0]


def lookup(tokens: jax.Array, length: jax.Array, spec: Speculation, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): for each row, the
    tokens that followed the latest earlier occurrence of its last n tokens, n from `ngram_max`
    down to `ngram_min` (the longest that occurs). Returns drafts [B, K] and how many are real [B]
    (K where a match was found, else 0). Tokens of rows below `kv_len` only."""
    K = spec.draft
    known = tokens[:, :kv_len]  # a row that steps has length ≤ kv_len
    at = jnp.arange(kv_len)[None, :]
    padded = jnp.pad(known, ((0, 0), (0, spec.ngram_max)), constant_values=-1)
    follow = jnp.full(length.shape, -1)  # [B]: where the draft starts in the row, -1 for none
    for n in range(spec.ngram_max, spec.ngram_min - 1, -1):
        suffix = jnp.take_along_axis(known, jnp.maximum(length[:, None] - n + jnp.arange(n), 0), axis=1)  # [B, n]
        match = (at + n < length[:, None]) & (length[:, None] > n)  # an earlier occurrence, a token after it
        for k in range(n):
            match &= padded[:, k : k + kv_len] == suffix[:, k : k + 1]
        latest = jnp.max(jnp.where(match, at, -1), axis=1)
        follow = jnp.where((follow < 0) & (latest >= 0), latest + n, follow)
    # Past the row's end the text is taken to repeat with the match's period (a loop of one token
    # drafts K of it, not one).
    period = jnp.maximum(length - follow, 1)[:, None]
    drafts = jnp.take_along_axis(known, jnp.clip(follow[:, None] + jnp.arange(K) % period, 0, kv_len - 1), axis=1)
    return drafts, jnp.where(follow >= 0, K, 0)


def draft_room(state: DecodeState, kv_len: int, cfg: ModelConfig, found: jax.Array | int) -> jax.Array:
    """How many of the drafts each row has (`found` [B]: prompt lookup's count, or K for a draft
    model) it may verify now [B]: none for a row that is done, does not speculate or is backing
    off; never past the kv bucket (the verified positions must lie inside it) or the row's budget
    (drafts past it are wasted)."""
    room = jnp.minimum(kv_len - state.length, state.limit - state.length - 1)
    if switch := longrope_switch(
        cfg
    ):  # a pass never feeds the switch position: plain decoding is prefilled again there
        room = jnp.where(state.length <= switch, jnp.minimum(room, switch - state.length), room)
    return jnp.where(~state.done & state.speculate & (state.backoff == 0), jnp.clip(found, 0, room), 0)


def model_drafts(
    draft_params: model.Params, state: DecodeState, spec: Speculation, kv_len: int
) -> tuple[jax.Array, KVCache]:
    """The draft model's K tokens after each row [B, K], and its cache. Each is drawn as the target
    draws the token at its position (the row's sampling settings and key), so where the two models'
    distributions are close the same noise picks the same token (`sampling._gumbel_max`), and a sampled
    row keeps drafts about as often as a greedy one. The cache holds all but the row's last two tokens
    (a verifying pass may keep every draft and add one), so the first step feeds both; each draft is
    then fed to make the next. What it writes past the row's kept tokens is overwritten when the row
    gets there; a recurrent draft's state is taken back to them by `verify_step` (`DeltaState.settle`)."""
    cache, seen, tokens = state.draft_cache, state.seen, []
    feed, write_at = _feed(state, 2, 2)
    for k in range(spec.draft):
        block = model.Block(feed, write_at, kv_len, drafting=spec.model.recurrent)
        (hidden,), cache = model.forward_blocks(draft_params, spec.model, [block], cache)
        logits = model.logits(draft_params, hidden[:, -1], spec.model)
        tokens.append(_sample_at(state.seeds, seen, state.sampler, logits, state.length + k, spec.model)[0])
        seen = seen.at[jnp.arange(seen.shape[0]), tokens[-1]].set(True)
        feed, write_at = tokens[-1][:, None], write_at[:, -1:] + 1
    return jnp.stack(tokens, axis=1), cache


def verify_step(
    params: model.Params,
    state: DecodeState,
    cfg: ModelConfig,
    kv_len: int,
    spec: Speculation,
    draft_params=None,
    constrain=None,
) -> DecodeState:
    """One pass that emits 1 to K+1 tokens per live row: its last token and its drafts go in at
    their positions; at each, the token plain decoding would sample there is sampled (given the
    drafts before it); the row keeps the drafts up to the first disagreement and then the model's
    own token. Rejected drafts' K/V stay in the cache past the row's length, where masks ignore
    them until they are overwritten. Rows without drafts make their one token. A constrained row's
    drafts go to its matcher first (`matchers.HostCall.check`): those the grammar takes are
    verified, each position under the mask that follows the drafts before it, so the row keeps
    what plain constrained steps would make.

    A verifying pass costs more than a plain one (SmolLM-135M shape, float32 on XLA CPU: 1.7-1.9×
    at K = 4), so it pays only where drafts are accepted. A row whose pass kept fewer than
    PAYING_DRAFTS drafts waits 1, 2, 4, ... up to MAX_BACKOFF steps before drafting again, and a pass
    that paid resets that: text that cannot be predicted from itself costs a vanishing share of
    verifying passes."""
    active = ~state.done
    B, S = state.tokens.shape
    K = spec.draft
    if spec.model:
        draft, draft_cache = model_drafts(draft_params, state, spec, kv_len)
        count = draft_room(state, kv_len, cfg, K)
        state = replace(state, draft_cache=draft_cache)
    else:
        draft, found = lookup(state.tokens, state.length, spec, kv_len)
        count = draft_room(state, kv_len, cfg, found)
    allowed = None
    if constrain is not None:  # constrained rows' drafts: those the grammar takes, and each position's mask
        W = state.allowed.shape[1]
        checked = constrain.check(
            jax.ShapeDtypeStruct((B, K * W + 1), jnp.int32), jnp.concatenate([draft, count[:, None]], 1)
        )
        count = jnp.minimum(count, checked[:, -1])
        allowed = jnp.concatenate([state.allowed[:, None], checked[:, :-1].reshape(B, K, W)], axis=1)
    j = jnp.arange(K + 1)
    last = _feed(state, 1, 1)[0]
    feed = jnp.concatenate([last, draft], axis=1)  # [B, K+1]
    positions = state.length[:, None] - 1 + j  # [B, K+1]
    write_at = jnp.where(active[:, None] & (j <= count[:, None]), positions, S)
    (hidden,), cache = model.forward_blocks(
        params, cfg, [model.Block(feed, write_at, kv_len, settle=cfg.recurrent)], state.cache
    )
    rows = jnp.arange(B)
    seen = [state.seen]  # what position j's repetition penalty sees: the row, then drafts before j
    for d in range(K):
        seen.append(seen[-1].at[rows, draft[:, d]].set(True))
    flat = lambda x: x.reshape(B * (K + 1), *x.shape[2:])  # noqa: E731
    each = lambda x: jnp.repeat(x, K + 1, axis=0)  # noqa: E731
    target, lp = _sample_at(
        each(state.seeds),
        flat(jnp.stack(seen, 1)),
        jax.tree.map(each, state.sampler),
        flat(model.logits(params, hidden, cfg)),
        flat(state.length[:, None] + j),
        cfg,
        state.logprobs is not None,
        None if allowed is None else flat(allowed),
        None if state.penalties is None else jax.tree.map(each, state.penalties),  # a penalized row drafts nothing
        None if state.guards is None else state.guards.per_row(lambda _, a: each(a)),  # a guarded row drafts nothing
        state.eos,
    )
    target = target.reshape(B, K + 1)
    lp = lp and tuple(x.reshape(B, K + 1, *x.shape[1:]) for x in lp)
    agree = jnp.cumprod((draft == target[:, :K]) & (j[:K] < count[:, None]), axis=1, dtype=jnp.int32).sum(1)  # [B]
    state = replace(state, cache=cache, passes=state.passes + active, drafted=state.drafted + count)
    # the kept drafts and the model's own token
    state, n = _append(state, target, active[:, None] & (j <= agree[:, None]), lp, constrain)
    if cfg.recurrent:  # the state over the row's last token and the drafts it kept (as many as it made)
        state = replace(state, cache=replace(state.cache, delta=state.cache.delta.settle(n)))
    if spec.model and spec.model.recurrent:  # the draft's over as many, from the token before
        state = replace(state, draft_cache=replace(state.draft_cache, delta=state.draft_cache.delta.settle(n)))
    kept = jnp.minimum(agree, n)
    paid = kept >= min(K, PAYING_DRAFTS)
    failed = (count > 0) & ~paid
    patience = jnp.where(failed, jnp.clip(2 * state.patience, 1, MAX_BACKOFF), jnp.where(count > 0, 0, state.patience))
    backoff = jnp.where(failed, patience, jnp.maximum(state.backoff - 1, 0))
    return replace(state, accepted=state.accepted + kept, backoff=backoff, patience=patience)


@partial(jax.jit, static_argnames=("cfg", "kv_len", "spec", "constrain"), donate_argnames=("state",))
def decode(
    params: model.Params,
    state: DecodeState,
    steps: jax.Array,
    stop_on_finish: jax.Array,
    draft_params: model.Params | None = None,
    *,
    cfg: ModelConfig,
    kv_len: int,
    spec: Speculation = Speculation(),
    constrain=None,
) -> DecodeState:
    """Up to `steps` decode steps, ending early once every row is done, or (`stop_on_finish`, a
    traced flag) as soon as any row finishes, so a batch can hand its slot to a waiting request.
    The caller keeps every live row inside `kv_len` for `steps` single-token steps (it caps
    `steps`); a speculative step may go further, so the loop also ends when a row reaches the
    bucket's end."""
    running = ~state.done

    def live(carry) -> jax.Array:
        i, s = carry
        finished = jnp.any(running & s.done) & stop_on_finish
        full = jnp.any(~s.done & (s.length > kv_len))  # its next query would sit past the bucket
        if switch := longrope_switch(cfg):  # a row to prefill again with longrope's long factors
            full |= jnp.any(~s.done & (s.length == switch + 1))
        return (i < steps) & ~jnp.all(s.done) & ~finished & ~full

    def plain(carry):
        i, s = carry
        return i + 1, decode_step(params, s, cfg, kv_len, spec, draft_params, constrain)

    if not spec.draft:
        return jax.lax.while_loop(live, plain, (jnp.int32(0), state))[1]

    # Plain steps while no row has drafts, verifying ones while some row has: two loops in turn, not
    # a lax.cond per step, which XLA CPU runs on a copy of the whole cache (a 4096-position cache
    # of the bundled model: 2.7 → 6.4 ms per step).
    def drafting(carry) -> jax.Array:
        s = carry[1]
        if spec.model:
            return jnp.any(draft_room(s, kv_len, cfg, spec.draft) > 0)
        # the lookup only where some row may draft: a row backing off (text that does not repeat
        # itself) would pay it every step (its token operands only: no cache in this cond)
        may = jnp.any(draft_room(s, kv_len, cfg, spec.draft) > 0)
        found = jax.lax.cond(may, lambda: lookup(s.tokens, s.length, spec, kv_len)[1], lambda: jnp.zeros_like(s.length))
        return jnp.any(draft_room(s, kv_len, cfg, found) > 0)

    def verify(carry):
        i, s = carry
        return i + 1, verify_step(params, s, cfg, kv_len, spec, draft_params, constrain)

    def alternate(carry):
        carry = jax.lax.while_loop(lambda c: live(c) & ~drafting(c), plain, carry)
        return jax.lax.while_loop(lambda c: live(c) & drafting(c), verify, carry)

    return jax.lax.while_loop(live, alternate, (jnp.int32(0), state))[1]
