"""A Gated DeltaNet mixer (Yang et al. 2024; Qwen3-Next, Qwen3.5): linear attention whose memory is a
fixed-size matrix per head, written by the delta rule and decayed by a learned gate, after a short
causal convolution. A row's state (`DeltaState`) is the convolution's last inputs and that matrix:
it does not grow with the context, and decode reads and writes it once a step.

Per token t and value head h, with q, k l2-normalised and q scaled by dk^-0.5, α = exp(g) the decay
and β the write strength:
    S ← α S;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq        (S [dk, dv], float32)
Decode takes that step (`recurrent`); a prompt goes in chunks of CHUNK tokens (`chunked`: the WY /
UT form of flash-linear-attention, as transformers' `torch_chunk_gated_delta_rule`), a few matrix
products per chunk and one sequential step per chunk instead of per token.

Leaves of a DeltaNet layer (`jaxinfer.families.hybrid`): the input projections, either Qwen3.5's
"wmix" [2·Hk·dk + Hv·dv, D] (q, k, v: what the convolution mixes), "wz" [Hv·dv, D] (the output gate),
"wb", "wa" [Hv, D], or Qwen3-Next's "wqkvz" and "wba" (per key head, its q, k, v and z rows; its b
and a; a GGUF file of it has "wmix", "wz" and "wba"); "conv" [C, 1, K], "a_log" and "dt_bias" [Hv],
"gate_norm" [dv] and "wo" [D, Hv·dv].

The layer holds its channels grouped by key head: key head h's q, its k, then the v of the value
heads it serves (`channel_order`), whatever order the checkpoint has (all q, all k, all v; a GGUF
file's value heads tiled over the key heads, `value_order`). Over a mesh a split of those rows by key
heads (`jaxinfer.sharding`) then gives each device whole heads: its convolution channels, its rule's
state, its share of the output gate and of o's inputs, nothing crossing devices until o's sum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.layers.feed_forward import linear

CHUNK = 64  # tokens per chunk of the chunked form (flash-linear-attention's and transformers')
# What a row keeps of its state beside the state now (`DeltaState.keep`): after its last prompt (a
# chat's next turn extends that prompt even where the reply, rendered again, is not the tokens
# generated), and at its mark, a place inside the prompt that other prompts share (a server's
# system prompt: `jaxinfer.scheduler`)
SNAPSHOTS = ("prompt", "mark")
HIGHEST = jax.lax.Precision.HIGHEST  # the state's products in full float32 on a GPU too


@jax.tree_util.register_dataclass
@dataclass
class DeltaState:
    """Every DeltaNet layer's state for each of B rows, by the layer's place among them. An array
    per layer, not one stacked array: a layer's state is read whole and replaced whole each step, and
    out of a stack XLA copied the whole stack to update one layer in place (the KV cache's trap,
    `jaxinfer.kvcache`): a decode step of one layer at B = 1 took 3.3 ms instead of 0.14."""

    conv: tuple  # per layer [B, K-1, C] compute dtype: the last K-1 inputs of the convolution
    recurrent: tuple  # per layer [B, Hv, dk, dv] float32: the memory matrix of each value head
    kept: tuple = ()  # per SNAPSHOTS entry, each row's (conv, recurrent) as above, kept there (`keep`)
    # within a verifying pass (`jaxinfer.decode.verify_step`), per layer what `settle` needs to move
    # each row's state over the tokens it keeps: the state before the pass and the pass's inputs of
    # the rule, (conv, recurrent, mixed [B, T, C], q, k [B, T, Hv, dk], v [B, T, Hv, dv], g, beta [B, T, Hv])
    pending: tuple | None = None

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, dtype) -> DeltaState | None:
        """An empty state for `batch` rows; None for a model without DeltaNet layers."""
        layers = len(delta_layers(cfg))
        if not layers:
            return None
        conv = (batch, cfg.delta_conv - 1, conv_channels(cfg))
        recurrent = (batch, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim)
        conv = tuple(jnp.zeros(conv, dtype) for _ in range(layers))
        recurrent = tuple(jnp.zeros(recurrent, jnp.float32) for _ in range(layers))
        return cls(conv, recurrent, tuple(jax.tree.map(jnp.copy, (conv, recurrent)) for _ in SNAPSHOTS))

    def copy_rows(self, src: jax.Array, dst: jax.Array) -> DeltaState:
        move = lambda arrays: jax.tree.map(lambda a: a.at[dst].set(a[src]), arrays)  # noqa: E731
        return DeltaState(move(self.conv), move(self.recurrent), move(self.kept))

    def keep(self, rows: jax.Array, **there: jax.Array) -> DeltaState:
        """Rows `rows` [R] keep their state as each snapshot (`SNAPSHOTS`) where they are `there`
        [R] (`prompt=`: at their prompt's end; `mark=`: at their mark)."""

        def one(at: jax.Array, kept: jax.Array, now: jax.Array) -> jax.Array:
            return kept.at[rows].set(jnp.where(at.reshape(-1, *[1] * (now.ndim - 1)), now[rows], kept[rows]))

        if unknown := set(there) - set(SNAPSHOTS):
            raise ValueError(f"no snapshot {unknown}: {SNAPSHOTS}")
        now = (self.conv, self.recurrent)
        kept = tuple(
            jax.tree.map(partial(one, there[name]), k, now) if name in there else k
            for name, k in zip(SNAPSHOTS, self.kept)
        )
        return replace(self, kept=kept)

    def restore(self, rows: jax.Array, snapshot: str) -> DeltaState:
        """Rows `rows` [R] go back to the state they kept as `snapshot`."""
        kept = self.kept[SNAPSHOTS.index(snapshot)]
        back = jax.tree.map(lambda a, k: a.at[rows].set(k[rows]), (self.conv, self.recurrent), kept)
        return replace(self, conv=back[0], recurrent=back[1])

    def read(self, layer: int, rows) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s (conv, recurrent) state of rows `rows` ([R] ids, or None: all)."""
        pick = lambda a: a if rows is None else a[rows]  # noqa: E731
        return pick(self.conv[layer]), pick(self.recurrent[layer])

    def write(self, layer: int, rows, conv: jax.Array, recurrent: jax.Array) -> DeltaState:
        """The state with layer `layer`'s rows `rows` (as `read`'s) replaced."""

        def put(arrays: tuple, value: jax.Array) -> tuple:
            new = value.astype(arrays[layer].dtype) if rows is None else arrays[layer].at[rows].set(value)
            return arrays[:layer] + (new,) + arrays[layer + 1 :]

        return replace(self, conv=put(self.conv, conv), recurrent=put(self.recurrent, recurrent))

    def hold(self, layer: int, layers: int, before: tuple, inputs: tuple) -> DeltaState:
        """Itself with layer `layer`'s state before a pass and the pass's inputs to its rule kept
        for `settle` (of `layers` DeltaNet layers); after passes already held (a draft model's
        drafting steps), the state before the first and the inputs of all, in order."""
        pending = self.pending or (None,) * layers
        if (earlier := pending[layer]) is not None:
            before = earlier[:2]
            inputs = tuple(jnp.concatenate(pair, axis=1) for pair in zip(earlier[2:], inputs))
        return replace(self, pending=pending[:layer] + ((*before, *inputs),) + pending[layer + 1 :])

    def settle(self, made: jax.Array) -> DeltaState:
        """After a verifying pass, each row's state moved over the first `made` [B] of the tokens
        the held passes fed (the target's: its last token and the drafts it kept; a draft model's:
        the same, one token earlier; 0 for a row that took no part): the rule again from the state
        before them, the tokens past them moving nothing. Recomputing keeps one state a layer, where
        keeping the state after every drafted token would hold K + 1."""
        conv, recurrent = list(self.conv), list(self.recurrent)
        for i, (before, memory, mixed, q, k, v, g, beta) in enumerate(self.pending):
            live = (jnp.arange(mixed.shape[1])[None, :] < made[:, None])[..., None]  # [B, T, 1]
            full = jnp.concatenate([before, mixed.astype(before.dtype)], axis=1)
            conv[i] = jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, before.shape[1], 0))(full, made)
            recurrent[i] = chunked(q, k, v, g * live, beta * live, memory)[1]
        return replace(self, conv=tuple(conv), recurrent=tuple(recurrent), pending=None)


def delta_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_layers) if cfg.mixer(i) == "delta")


def conv_channels(cfg: ModelConfig) -> int:
    """What the convolution mixes per token: q and k of every key head, v of every value head."""
    return 2 * cfg.delta_heads * cfg.delta_key_dim + cfg.delta_value_heads * cfg.delta_value_dim


def value_order(cfg: ModelConfig) -> np.ndarray:
    """The layer's value heads (key head h's r = Hv/Hk: h·r … h·r + r − 1) as indices into the
    checkpoint's: the same, or tiled over the key heads (`delta_tiled`, a GGUF file's: i·Hk + h)."""
    Hk, r = cfg.delta_heads, cfg.delta_value_heads // cfg.delta_heads
    h, i = np.divmod(np.arange(Hk * r), r)
    return i * Hk + h if cfg.delta_tiled else h * r + i


def value_rows(cfg: ModelConfig, size: int = 1) -> tuple[int, ...] | None:
    """The rows of a tensor with `size` rows a value head (z: dv; b, a, A, dt_bias: 1) as the layer
    holds them, by their index in the checkpoint's; None where the orders are the same."""
    if not cfg.delta_tiled:
        return None
    return tuple((value_order(cfg)[:, None] * size + np.arange(size)).ravel().tolist())


def channel_order(cfg: ModelConfig) -> tuple[int, ...]:
    """The convolution's channels as the layer holds them, grouped by key head (its q, its k, its
    value heads' v), by their index in the checkpoint's (every q, every k, every v)."""
    Hk, dk, dv = cfg.delta_heads, cfg.delta_key_dim, cfg.delta_value_dim
    heads = value_order(cfg).reshape(Hk, -1)
    groups = [
        np.concatenate(
            [
                h * dk + np.arange(dk),
                (Hk + h) * dk + np.arange(dk),
                2 * Hk * dk + (heads[h, :, None] * dv + np.arange(dv)).ravel(),
            ]
        )
        for h in range(Hk)
    ]
    return tuple(np.concatenate(groups).tolist())


def state_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """One row's state over all DeltaNet layers, in bytes: what a decode step reads and writes (a row
    holds it once more for each of its SNAPSHOTS)."""
    per_layer = (cfg.delta_conv - 1) * conv_channels(cfg) * dtype_bytes
    per_layer += cfg.delta_value_heads * cfg.delta_key_dim * cfg.delta_value_dim * 4
    return len(delta_layers(cfg)) * per_layer


def _projections(layer: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """x [N, D] → the convolution's input [N, C] (grouped by key head: `channel_order`), the output
    gate z [N, Hv, dv], and b, a [N, Hv]."""
    N = x.shape[0]
    Hk, Hv, dk, dv = cfg.delta_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim
    r = Hv // Hk
    if "wqkvz" in layer:  # Qwen3-Next: per key head, its q, k, then its value heads' v and z
        qkvz = linear(x, layer, "qkvz", cfg).reshape(N, Hk, 2 * dk + 2 * r * dv)
        mixed, z = jnp.split(qkvz, [2 * dk + r * dv], axis=-1)
        mixed = mixed.reshape(N, -1)
    else:
        mixed, z = linear(x, layer, "mix", cfg), linear(x, layer, "z", cfg)
    if "wba" in layer:  # Qwen3-Next: per key head, its value heads' b, then their a
        b, a = jnp.split(linear(x, layer, "ba", cfg).reshape(N, Hk, 2 * r), 2, axis=-1)
    else:
        b, a = linear(x, layer, "b", cfg), linear(x, layer, "a", cfg)
    return mixed, z.reshape(N, Hv, dv), b.reshape(N, Hv), a.reshape(N, Hv)


def _convolve(x: jax.Array, before: jax.Array, weight: jax.Array, live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal convolution and its SiLU: x [R, T, C] after the row's earlier inputs
    `before` [R, K-1, C], weight [C, 1, K]. Returns the outputs [R, T, C] and the last K-1
    inputs of the live tokens (`live` [R, T], a prefix of each row): the next call's `before`."""
    K = weight.shape[-1]
    T = x.shape[1]
    full = jnp.concatenate([before.astype(x.dtype), x], axis=1)  # [R, K-1+T, C]
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    out = sum(full[:, k : k + T].astype(jnp.float32) * w[:, k] for k in range(K))
    kept = jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, K - 1, 0))(full, live.sum(1))
    return jax.nn.silu(out).astype(x.dtype), kept  # rounded as transformers rounds it


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def recurrent(q, k, v, g, beta, state):
    """One token per row: q, k [R, H, dk], v [R, H, dv], g, beta [R, H], state [R, H, dk, dv] →
    (output [R, H, dv], the new state)."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("rhkv,rhk->rhv", state, k, precision=HIGHEST)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("rhkv,rhk->rhv", state, q, precision=HIGHEST), state


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """The inverse of I + the strictly lower triangle of `lower` [..., c, c] (c a power of two),
    by blocks doubling in size: inv [[A, 0], [C, D]] = [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]]. On XLA CPU
    a few batched products; `jax.lax.linalg.triangular_solve` took 3× as long (16 heads, two
    chunks of 64: 2.2 → 0.7 ms), and it was a third of a DeltaNet layer's prefill."""
    c, batch = lower.shape[-1], lower.shape[:-2]
    inverse = jnp.ones(batch + (c, 1, 1), lower.dtype)  # [..., blocks, size, size]
    size = 1
    while size < c:
        pairs = c // (2 * size)
        diagonal = jnp.diagonal(lower.reshape(batch + (pairs, 2 * size, pairs, 2 * size)), axis1=-4, axis2=-2)
        below = jnp.moveaxis(diagonal, -1, -3)[..., size:, :size]  # C of each pair's block
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -jnp.matmul(jnp.matmul(second, below, precision=HIGHEST), first, precision=HIGHEST)
        top = jnp.concatenate([first, jnp.zeros_like(first)], -1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, second], -1)], -2)
        size *= 2
    return inverse[..., 0, :, :]


def chunked(q, k, v, g, beta, state):
    """T tokens per row in chunks of CHUNK: q, k [R, T, H, dk], v [R, T, H, dv], g, beta [R, T, H],
    state [R, H, dk, dv] → (outputs [R, T, H, dv], the state after the last token). Within a chunk
    the delta rule's T sequential updates become one unit-triangular solve (the UT transform);
    across chunks the state is carried by a scan. Tokens with g = β = 0 leave the state as it was
    (padding, here and in a prompt's bucket)."""
    R, T, H, dk = q.shape
    c = min(CHUNK, 1 << (T - 1).bit_length())  # a power of two (`unit_lower_inverse`)
    pad = -T % c
    q, k, v, g, beta = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta))
    n = (T + pad) // c
    # [R, H, n, c, ...]
    q, k, v = (a.reshape(R, n, c, H, -1).transpose(0, 3, 1, 2, 4) for a in (q, k, v))
    g, beta = (a.reshape(R, n, c, H).transpose(0, 3, 1, 2) for a in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = jnp.cumsum(g, axis=-1)  # [R, H, n, c]: log of the decay from the chunk's start
    causal = jnp.tril(jnp.ones((c, c), bool))
    pairwise = jnp.exp(jnp.where(causal, decay[..., :, None] - decay[..., None, :], -jnp.inf))  # [.., c, c]
    dot = lambda a, b: jnp.einsum("...ik,...jk->...ij", a, b, precision=HIGHEST)  # noqa: E731
    system = dot(k_beta, k) * pairwise  # unit lower triangular once its diagonal is taken as 1
    within = dot(q, k) * pairwise
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(decay)[..., None]], -1)
    solved = jnp.matmul(unit_lower_inverse(system), rhs, precision=HIGHEST)
    new_values, k_decayed = jnp.split(solved, [v.shape[-1]], -1)  # [R, H, n, c, dv], [R, H, n, c, dk]
    q = q * jnp.exp(decay)[..., None]
    k = k * jnp.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = jnp.exp(decay[..., -1])[..., None, None]  # [R, H, n, 1, 1]

    def one(state, xs):
        q, k, new_values, k_decayed, within, chunk_decay = xs
        fresh = new_values - jnp.einsum("rhck,rhkv->rhcv", k_decayed, state, precision=HIGHEST)
        out = jnp.einsum("rhck,rhkv->rhcv", q, state, precision=HIGHEST)
        out = out + jnp.einsum("rhcd,rhdv->rhcv", within, fresh, precision=HIGHEST)
        state = state * chunk_decay + jnp.einsum("rhck,rhcv->rhkv", k, fresh, precision=HIGHEST)
        return state, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, new_values, k_decayed, within, chunk_decay))
    state, out = jax.lax.scan(one, state, xs)  # out [n, R, H, c, dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(R, n * c, H, -1)
    return out[:, :T], state


def mix(layer: dict, x: jax.Array, blocks: list, cache, i: int, cfg: ModelConfig):
    """Layer i's DeltaNet over the blocks' tokens x [N, D] (`jaxinfer.model.Block`s, flattened in
    order), each block from and into its rows' state in `cache.delta` (None: whole sequences from
    an empty state; a block's row at position 0 starts from one too). A block's token is live where
    `Block.live` says (a prompt's bucket padding is not), else where its position lies inside the
    cache (a finished row's lies past it): only live tokens move the state. Returns ([N, D], the
    cache)."""
    N = x.shape[0]
    Hk, Hv, dk, dv = cfg.delta_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim
    mixed, z, b, a = _projections(layer, x, cfg)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [N, Hv]
    g = -jnp.exp(layer["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + layer["dt_bias"].astype(jnp.float32)
    )
    state = None if cache is None else cache.delta
    at_layer = delta_layers(cfg).index(i)
    outs, at = [], 0
    for block in blocks:
        R, T = block.tokens.shape
        here = slice(at, at + R * T)
        at += R * T
        if block.live is not None:
            live = block.live
        elif cache is not None:
            live = block.positions < cache.length
        else:
            live = jnp.ones((R, T), bool)
        if state is None:
            before = jnp.zeros((R, cfg.delta_conv - 1, mixed.shape[-1]), x.dtype)
            memory = jnp.zeros((R, Hv, dk, dv), jnp.float32)
        else:  # a row starting at position 0 starts empty, whatever its last sequence left
            rows = block.rows if block.rows is not None or R == len(state.recurrent[0]) else jnp.arange(R)
            before, memory = state.read(at_layer, rows)
            empty = (block.positions[:, 0] == 0)[:, None, None]
            before, memory = jnp.where(empty, 0, before), jnp.where(empty[..., None], 0.0, memory)
        start, mixed_in = memory, mixed[here].reshape(R, T, -1)
        convolved, kept = _convolve(mixed_in, before, layer["conv"], live)
        grouped = convolved.astype(jnp.float32).reshape(R, T, Hk, -1)
        q, k, v = jnp.split(grouped, [dk, 2 * dk], axis=-1)
        # each key head serves the Hv/Hk value heads after it
        q, k = (jnp.repeat(t, Hv // Hk, axis=2) for t in (_l2norm(q) * dk**-0.5, _l2norm(k)))
        v = v.reshape(R, T, Hv, dv)
        bg, bbeta = (jnp.where(live[..., None], t[here].reshape(R, T, Hv), 0.0) for t in (g, beta))
        if T == 1:
            out, memory = recurrent(q[:, 0], k[:, 0], v[:, 0], bg[:, 0], bbeta[:, 0], memory)
            out = out[:, None]
        else:
            out, memory = chunked(q, k, v, bg, bbeta, memory)
        if state is not None and (block.settle or block.drafting):  # held for `settle`
            state = state.hold(at_layer, len(delta_layers(cfg)), (before, start), (mixed_in, q, k, v, bg, bbeta))
        if state is not None and not block.settle:  # a verifying pass's state waits for `settle`
            state = state.write(at_layer, rows, kept, memory)
        outs.append(out.reshape(R * T, Hv, dv))
    out = gated_norm(jnp.concatenate(outs).astype(x.dtype), z, layer["gate_norm"], cfg.rms_norm_eps)
    if cfg.delta_tiled:  # o's inputs as the checkpoint has them (a k-quant's blocks span two heads: not reordered)
        out = out.reshape(N, Hk, Hv // Hk, dv).swapaxes(1, 2)
    if cache is not None:
        cache = replace(cache, delta=state)
    return linear(out.reshape(N, Hv * dv), layer, "o", cfg), cache


def gated_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of each head's output x [N, H, dv] (scaled by weight, not 1 + weight), times SiLU of
    its gate, as transformers rounds it: normalised in float32, cast, scaled, gated in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scaled = weight * x32.astype(x.dtype)
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
