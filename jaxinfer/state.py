"""The decode loop's state and what the host does to its rows between programs: one documented
pytree (`DecodeState`) that `jaxinfer.decode`'s programs take donated and give back, how it starts
(`initial_state`), a prompt's arguments for `prefill` (`admission`), and the small programs that
copy (`copy_rows`) or stop (`retire`) rows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import model
from jaxinfer.config import ModelConfig
from jaxinfer.constrain import mask_words
from jaxinfer.kvcache import KVCache
from jaxinfer.sampling import TOP_LOGPROBS, Guards, Penalties, SamplerArrays, Sampling
from jaxinfer.sharding import mesh_of


@jax.tree_util.register_dataclass
@dataclass
class Logprobs:
    """Each token's log-probability by position, as `sampling.logprobs` gives them, where a row's
    tokens are recorded with them (prompt positions hold zeros)."""

    chosen: jax.Array  # [B, S] float32: the token at the position
    ids: jax.Array  # [B, S, N] int32: the N most likely tokens there
    top: jax.Array  # [B, S, N] float32: theirs

    @classmethod
    def zeros(cls, batch: int, max_context: int, cfg: ModelConfig) -> Logprobs:
        n = min(TOP_LOGPROBS, cfg.sampled_ids)
        return cls(
            jnp.zeros((batch, max_context), jnp.float32),
            jnp.zeros((batch, max_context, n), jnp.int32),
            jnp.zeros((batch, max_context, n), jnp.float32),
        )

    def at(self, row: int, position: int) -> tuple:
        """One token's, as the host keeps them: (chosen, ids [N], top [N])."""
        return float(self.chosen[row, position]), self.ids[row, position], self.top[row, position]


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
    speculate: jax.Array  # [B] bool: the row drafts by prompt lookup when the loop speculates
    drafted: jax.Array  # [B] int32: since the row started, draft tokens it verified
    accepted: jax.Array  # [B] int32: of them, those the model agreed with and the row kept
    passes: jax.Array  # [B] int32: decode steps (forward passes) the row took part in
    backoff: jax.Array  # [B] int32: steps before the row drafts again (after drafts that all failed)
    patience: jax.Array  # [B] int32: the backoff its next failure sets: doubled per failure, 0 after a success
    draft_cache: KVCache | None = (
        # the draft model's, where one drafts: K/V of all but a row's last two tokens (at least: of
        # drafts it went on to make), a recurrent state after exactly those (`decode.model_drafts`)
        None
    )
    # where log-probabilities are recorded (a static choice: the programs differ by the state's shape)
    logprobs: Logprobs | None = None
    # where rows are constrained (`jaxinfer.constrain`): [B, W] int32 bitmasks of the tokens each row
    # may sample next (bit t % 32 of word t // 32), every bit set in a free row
    allowed: jax.Array | None = None
    # where rows may have a logit bias or presence/frequency penalties (`sampling.Penalties`)
    penalties: Penalties | None = None
    # where rows may have a floor under EOS (min_tokens) or a thinking budget (`sampling.Guards`)
    guards: Guards | None = None


@dataclass(frozen=True)
class Speculation:
    """How the decode loop speculates (static: part of the program). `draft` 0 is off. With a
    draft `model` (its config; its parameters go to `prefill` and `decode` beside the target's),
    its tokens are the drafts (`model_drafts`); without one, n-grams of `ngram_max` down to `ngram_min`
    tokens are looked up, the longest that occurs winning."""

    draft: int = 0
    ngram_max: int = 3
    ngram_min: int = 1
    model: ModelConfig | None = None


def initial_state(
    cfg: ModelConfig,
    params: model.Params,
    batch: int,
    max_context: int,
    eos_ids: tuple[int, ...],
    spec: Speculation = Speculation(),
    draft_params: model.Params | None = None,
    record_logprobs: bool = False,
    constrained: bool = False,
    penalized: bool = False,
    markers: tuple[tuple[int, ...], ...] | None = None,
) -> DecodeState:
    """An empty state: zero caches in the weights' dtypes, every row done; with `record_logprobs`,
    room for each position's log-probabilities; with `constrained`, every row's token mask; with
    `penalized`, every row's logit bias and counts of generated tokens; with `markers` (a thinking
    block's opener, closer and forced end: `Guards`), every row's guards."""
    whole = mesh_of(params) is None
    draft_cache = (
        KVCache.zeros(spec.model, batch, max_context, model.compute_dtype(draft_params), whole) if spec.model else None
    )
    return DecodeState(
        cache=KVCache.zeros(cfg, batch, max_context, model.compute_dtype(params), whole),
        tokens=jnp.zeros((batch, max_context), jnp.int32),
        length=jnp.zeros((batch,), jnp.int32),
        limit=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        seen=jnp.zeros((batch, cfg.vocab_size), bool),
        seeds=jnp.zeros((batch,), jnp.int32),
        ignore_eos=jnp.zeros((batch,), bool),
        sampler=SamplerArrays.from_settings([Sampling()] * batch),
        eos=jnp.asarray(eos_ids or (-1,), jnp.int32),
        speculate=jnp.zeros((batch,), bool),
        drafted=jnp.zeros((batch,), jnp.int32),
        accepted=jnp.zeros((batch,), jnp.int32),
        passes=jnp.zeros((batch,), jnp.int32),
        backoff=jnp.zeros((batch,), jnp.int32),
        patience=jnp.zeros((batch,), jnp.int32),
        draft_cache=draft_cache,
        logprobs=Logprobs.zeros(batch, max_context, cfg) if record_logprobs else None,
        allowed=jnp.full((batch, mask_words(cfg.sampled_ids)), -1, jnp.int32) if constrained else None,
        penalties=Penalties.zeros(batch, cfg.vocab_size) if penalized else None,
        guards=None if markers is None else jax.device_put(Guards.zeros(batch, markers)),
    )


def admission(
    rows: list[int],
    prompts: list[list[int]],
    starts: list[int],
    ends: list[int],
    limits: list[int],
    seeds: list[int],
    samplings: list[Sampling],
    ignore_eos: list[bool],
    speculate: list[bool],
    bucket: int,
    allowed: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    guards: tuple[np.ndarray, ...] | None = None,
    marks: list[int] | None = None,
) -> tuple:
    """`prefill`'s arguments after the state: each row's prompt tokens `start:end`, padded to
    `bucket`; the chunk is final where `end` is the prompt's end, and ends at the row's mark where
    `end` is its mark (`marks`: a hybrid's, 0 for none); where rows are constrained, their
    first token's masks `allowed` [R, W]; where the state is penalized, their logit bias [R, V];
    where it is guarded, their (floor, budget, left) [R] each (`Guards.rows`).
    Host values go over with one device_put (jnp.asarray would compile a conversion program per call)."""
    chunk = np.zeros((len(rows), bucket), np.int32)
    for i, (prompt, start, end) in enumerate(zip(prompts, starts, ends)):
        chunk[i, : end - start] = prompt[start:end]
    lengths = [end - start for start, end in zip(starts, ends)]
    final = [end == len(prompt) for prompt, end in zip(prompts, ends)]
    marked = [end == mark for mark, end in zip(marks or [0] * len(rows), ends)]
    host = tuple(np.asarray(x, np.int32) for x in (rows, chunk, starts, lengths))
    host += (np.asarray(final, bool), np.asarray(marked, bool))
    host += (np.asarray([len(prompt) for prompt in prompts], np.int32),)  # picks longrope's factors
    seeds = np.asarray([seed % 2**32 for seed in seeds], np.uint32).view(np.int32)  # any integer: its low 32 bits
    host += (np.asarray(limits, np.int32), seeds, np.asarray(ignore_eos, bool), np.asarray(speculate, bool))
    return jax.device_put(host) + (
        SamplerArrays.from_settings(samplings),
        None if allowed is None else jax.device_put(allowed),
        None if bias is None else jax.device_put(bias),
        None if guards is None else jax.device_put(guards),
    )


@partial(jax.jit, donate_argnames=("state",))
def copy_rows(params: model.Params, state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Rows `dst` [R] take the tokens of rows `src` [R] with their K/V (the target's and a draft
    model's), so that `prefill` can go on from any length the source held. What lies past that
    length is overwritten before it is read (masks come from positions)."""
    del params  # the programs' shared signature (`Slots._program`)
    return replace(
        state,
        cache=state.cache.copy_rows(src, dst),
        tokens=state.tokens.at[dst].set(state.tokens[src]),
        draft_cache=state.draft_cache and state.draft_cache.copy_rows(src, dst),
    )


@partial(jax.jit, static_argnames=("snapshot",), donate_argnames=("state",))
def restore_rows(params: model.Params, state: DecodeState, rows: jax.Array, *, snapshot: str) -> DecodeState:
    """Rows `rows` [R] of a hybrid (target or draft) go back to the DeltaNet state they kept as
    `snapshot` (`delta_net.SNAPSHOTS`: after their last prompt, a draft's one token short of it,
    `decode.catch_up`; at their mark), so that `prefill` can go on from there."""
    del params  # the programs' shared signature (`Slots._program`)

    def back(cache: KVCache | None) -> KVCache | None:
        if cache is None or cache.delta is None:
            return cache
        return replace(cache, delta=cache.delta.restore(rows, snapshot))

    return replace(state, cache=back(state.cache), draft_cache=back(state.draft_cache))


@partial(jax.jit, donate_argnames=("state",))
def retire(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Mark rows [B] bool as done (their text hit a stop string): the loop stops spending on them."""
    return replace(state, done=state.done | rows)
