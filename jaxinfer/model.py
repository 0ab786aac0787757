"""The decoder-only transformer every family shares, as pure functions over a parameter pytree.

Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm) and Gemma 1/2/3 (GeGLU, (1 + w) norms,
scaled embeddings, soft-capping, norms around each block, a rope base per layer type) differ only in
flags of `ModelConfig` (`jaxinfer.families` sets them); each layer's feed-forward part, dense or a
mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE), is `jaxinfer.layers.feed_forward`'s, and its
mixer attention (here) or a Gated DeltaNet (`jaxinfer.layers.delta_net`: Qwen3-Next, Qwen3.5). A matrix is
in one of the forms of `jaxinfer.forms` (Hugging Face's [out, in], [in, out], packed for the CPU
kernel, quantized, a mixture's stack of experts), which does its products and row lookups.

Attention over a float cache runs on the CPU kernel where it is built (`KVCache.attend`: each key
read once per block of queries, the softmax never leaving the cache); on a GPU a fresh prompt's on
cuDNN's flash attention where it fits (`flash`), all else over the cache on the Pallas kernel of
`jaxinfer.gpu_attention` (each query up to its own position, split over the keys); elsewhere (an
int8 cache on the CPU, a mesh) on XLA's einsums below.

A Python loop over layers (not `lax.scan` over stacked weights): on XLA CPU a scan copies every
layer's weights out of the stack before each matmul, which halves decode speed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer import forms, gpu_attention
from jaxinfer.config import ModelConfig, rope_inv_freq
from jaxinfer.kvcache import KVCache, quantize_heads
from jaxinfer.layers import altup, delta_net
from jaxinfer.layers.feed_forward import ACTIVATIONS, feed_forward, linear
from jaxinfer.layers.norm import rms_norm

Params = dict  # {"embed", "layers": [ {...} per layer ], "norm", optional "lm_head"}


def compute_dtype(params: Params):
    """The dtype activations (and the KV cache) are computed in: the weights' float dtype, which
    the final norm always has (quantized matrices are integers)."""
    return params["norm"].dtype


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, T, N, hd] by its positions [B, T] (the rotate-half convention of transformers),
    inv_freq [hd/2] or per token [B, T, hd/2]; with fewer frequencies than hd/2 (a partial rotary
    factor), the first 2·len(inv_freq) dims only. `scale`: longrope's attention factor on cos and sin."""
    rotary = 2 * inv_freq.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq, scale), x[..., rotary:]], -1)
    freqs = positions[:, :, None].astype(jnp.float32) * inv_freq  # [B, T, hd/2]
    cos = (jnp.cos(jnp.concatenate([freqs, freqs], -1)) * scale)[:, :, None, :]  # [B, T, 1, hd]
    sin = (jnp.sin(jnp.concatenate([freqs, freqs], -1)) * scale)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x.dtype)


def rope_factors(cfg: ModelConfig, i: int, rope_len: jax.Array) -> tuple[jax.Array, float]:
    """Layer i's inverse frequencies ([hd/2], or per token [B, T, hd/2] under longrope) and the
    factor on cos and sin (longrope's and YaRN's attention factor). longrope takes its long factors
    where the sequence is longer than the original context, as transformers decides per forward
    pass by its last position: `rope_len` [B, T] (or [B, 1]) is that length for each token: the
    whole prompt's for a prompt (chunked or not), each decoded token's own (a speculative check
    computes its tokens as plain decoding would)."""
    sliding, hd = cfg.sliding_windows[i] is not None, cfg.head_dim_of(i)
    inv_freq = jnp.asarray(rope_inv_freq(cfg, sliding, head_dim=hd))
    scaling = cfg.rope_local[1] if sliding and cfg.rope_local else cfg.rope_scaling
    if scaling[0] == "yarn":
        return inv_freq, scaling[-1]
    if scaling[0] != "longrope":
        return inv_freq, 1.0
    _, _, _, original, scale = scaling
    long = jnp.asarray(rope_inv_freq(cfg, sliding, long=True, head_dim=hd))
    return jnp.where((rope_len > original)[..., None], long, inv_freq), scale


def temperature_scaled(q: jax.Array, positions: jax.Array, beta: float, length: int) -> jax.Array:
    """Queries [B, T, H, hd] times 1 + beta · log(1 + ⌊position / length⌋) (Llama 4's attention
    temperature, as Ministral 3 takes it after RoPE): 1 within the first `length` positions."""
    scale = 1 + beta * jnp.log1p(jnp.floor(positions.astype(jnp.float32) / length))
    return (q * scale[:, :, None, None].astype(q.dtype)).astype(q.dtype)


FLASH: str | None = None  # jax.nn.dot_product_attention's implementation for `flash`; None: the backend's


def flash(cfg: ModelConfig, dtype, i: int) -> str | None:
    """The fused attention a prompt from its start takes over its own keys in layer i, where the
    backend has one: cuDNN's flash attention on NVIDIA GPUs (causal, grouped-query, sliding windows;
    16-bit, head dims up to 128, no soft-capping or sinks), which never holds a [T, T] score matrix in
    memory. None elsewhere (XLA CPU's own path, or `KVCache.attend`'s kernel, is faster there).
    `FLASH` = "xla" runs the same call through XLA, so the CPU tests check what the GPU runs."""
    implementation = FLASH or ("cudnn" if jax.default_backend() == "gpu" else None)
    if implementation is None or cfg.attn_softcap or cfg.kv_dtype == "int8" or cfg.attn_sinks:
        return None
    sixteen_bit = dtype in (jnp.bfloat16, jnp.float16)
    if implementation == "cudnn" and (not sixteen_bit or cfg.head_dim_of(i) % 8 or cfg.head_dim_of(i) > 128):
        return None
    return implementation


# Keys per step of a chunk's attention (SmolLM-135M shape, 16 queries at position 2500, 30 layers:
# blocks of 256 / 512 / 1024 keys 59 / 52 / 65 ms; all 4096 keys of the bucket at once 138 ms).
KEY_BLOCK = 512


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S]: a query (at q_pos [B, T]) sees keys (at k_pos [S]) at positions ≤ its own (and
    within the sliding window)."""
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return mask


@dataclass(frozen=True)
class Block:
    """Tokens [R, T] at positions [R, T] of cache rows `rows` [R] (None: the first R), attending over
    the first `kv_len` cache positions (static). `rope_len` [R, T] or [R, 1]: the sequence length
    that picks longrope's factors (`rope_factors`); None: each token's own position + 1 (a whole
    sequence's length without a cache)."""

    tokens: jax.Array
    positions: jax.Array
    kv_len: int
    rows: jax.Array | None = None
    rope_len: jax.Array | None = None
    fresh: bool = False  # positions 0..T-1 in every row: its own keys are all it attends to (`flash`)
    # [R, T] bool: the tokens that move a recurrent mixer's state (a prompt's bucket padding does
    # not); None: those at positions inside the cache (`delta_net.mix`)
    live: jax.Array | None = None
    # a verifying pass of drafted tokens: a recurrent mixer's state stays as it was, with what the
    # pass computed, until `delta_net.DeltaState.settle` moves each row's over the tokens it keeps
    settle: bool = False
    # a draft model's drafting pass: its recurrent state moves, and what moved it is held after
    # the earlier drafting passes' of the step, so that `settle` can take it back to the tokens the
    # target keeps
    drafting: bool = False


def attention(
    layer: dict, x: jax.Array, blocks: list[Block], cache: KVCache | None, i: int, cfg: ModelConfig
) -> tuple[jax.Array, KVCache | None]:
    """Layer i's attention for the blocks' tokens x [N, D] (in the blocks' order, each flattened):
    the projections over all N at once, each block's attention over its own rows."""
    H, KV, hd = cfg.num_heads, cfg.kv_heads_of(i), cfg.head_dim_of(i)
    shared = cfg.kv_source(i) != i  # Gemma 4: attends over an earlier layer's K/V, computes none
    q_out = 2 * H * hd if cfg.attn_output_gate else H * hd
    if "wqkv" in layer:  # Phi-3's, or stacked on a GPU (`forms.FUSED`)
        q, k, v = jnp.split(linear(x, layer, "qkv", cfg), [q_out, q_out + KV * hd], axis=-1)
    elif shared:
        q, k, v = linear(x, layer, "q", cfg), None, None
    else:
        q, k = linear(x, layer, "q", cfg), linear(x, layer, "k", cfg)
        v = k if i in cfg.keys_as_values else linear(x, layer, "v", cfg)  # Gemma 4's full layers: one projection
    if cfg.attn_output_gate:  # each head's query, then its gate
        q, gate = jnp.split(q.reshape(-1, H, 2 * hd), 2, axis=-1)
        q, gate = q.reshape(-1, H * hd), gate.reshape(-1, H * hd)
    if cfg.qk_norm == "whole":  # OLMoE: over all heads at once
        q, k = rms_norm(q, layer["q_norm"], cfg), rms_norm(k, layer["k_norm"], cfg)
    if cfg.clip_qkv:
        q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
    q = q.reshape(-1, H, hd)
    if cfg.qk_norm == "heads":
        q = rms_norm(q, layer["q_norm"], cfg)
    if not shared:
        k, v = k.reshape(-1, KV, hd), v.reshape(-1, KV, hd)
        k = rms_norm(k, layer["k_norm"], cfg) if cfg.qk_norm == "heads" else k
        v = rms_norm(v, None, cfg) if cfg.v_norm else v
    # Every block's K/V written before any block attends: a scatter into the cache after a read of
    # it made XLA copy the whole cache (two blocks, a 4096-position cache: 34 → 940 ms a call).
    rotated, at = [], 0
    for block in blocks:
        R, T = block.tokens.shape
        bq, bk, bv = [None if a is None else a[at : at + R * T].reshape(R, T, *a.shape[1:]) for a in (q, k, v)]
        if i not in cfg.nope_layers:
            inv_freq, scale = rope_factors(cfg, i, block.rope_len)
            bq = apply_rope(bq, block.positions, inv_freq, scale)
            bk = None if shared else apply_rope(bk, block.positions, inv_freq, scale)
        if cfg.query_temperature:
            bq = temperature_scaled(bq, block.positions, *cfg.query_temperature)
        if cache is not None and not shared:
            cache = cache.write(i, bk, bv, block.positions, block.rows)
        rotated.append((bq, bk, bv))
        at += R * T
    sinks = layer.get("sinks")
    outs = [_block_attention(*qkv, block, cache, i, cfg, sinks) for qkv, block in zip(rotated, blocks)]
    out = jnp.concatenate([out.astype(x.dtype).reshape(-1, H * hd) for out in outs])
    if cfg.attn_output_gate:
        out = out * jax.nn.sigmoid(gate)
    return linear(out, layer, "o", cfg), cache


MIXERS = {"attention": attention, "delta": delta_net.mix}  # a layer's mixer, by `ModelConfig.mixer`


def _block_attention(q, k, v, block: Block, cache: KVCache | None, i: int, cfg: ModelConfig, sinks=None) -> jax.Array:
    """One block's attention [R, T, KV, G, hd] (or [R, KV, G, hd] for T = 1 on XLA): its queries
    [R, T, H, hd] over the cache's first `kv_len` positions, its K/V already written there; without
    a cache, over its own keys and values [R, T, KV, hd]. `sinks` [H]: each head's sink logit
    (gpt-oss), which joins the softmax's denominator and weighs no value."""
    B, T, H, hd = q.shape
    KV = cfg.kv_heads_of(i)
    positions, rows, kv_len = block.positions, block.rows, block.kv_len
    window, scale, softcap = cfg.sliding_windows[i], cfg.attn_scale or hd**-0.5, cfg.attn_softcap
    own = k is not None  # else an earlier layer's K/V, in the cache (Gemma 4's shared layers)
    if T > 1 and own and (block.fresh or cache is None) and (implementation := flash(cfg, q.dtype, i)):
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=True,
            local_window_size=None if window is None else (window - 1, 0),
            implementation=implementation,
        )
        return out.reshape(B, T, KV, H // KV, hd)
    q = q.reshape(B, T, KV, H // KV, hd)  # grouped-query: G = H // KV query heads per kv head
    if cache is None:  # a whole sequence from position 0 (training, perplexity): its own keys
        kv_len = T
        kv = (k, v, None, None)
        if cfg.kv_dtype == "int8":  # as a cache would store them: perplexity judges the cache's int8
            (keys, k_scale), (values, v_scale) = quantize_heads(k), quantize_heads(v)
            kv = (keys, values, k_scale, v_scale)
        elif cfg.kv_dtype == "bfloat16":  # and its 16 bits
            kv = (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None)
        if T > 1 and gpu_attention.here(cfg, q.dtype):  # on a GPU its kernel, over them as a one-layer cache
            stored = [None if a is None else a[None] for a in kv]
            return gpu_attention.attend(q, positions, *stored, 0, None, T, window, scale, softcap, sinks)
        read = lambda start, size: [None if a is None else jax.lax.dynamic_slice_in_dim(a, start, size, 1) for a in kv]  # noqa: E731
    else:
        read = lambda start, size: cache.read(i, start, size, rows)  # noqa: E731

    if cache is not None and cache.attends(T):  # the CPU's kernel, the GPU's for more than one query
        return cache.attend(i, q, positions, rows, kv_len, window, scale, softcap, sinks)
    # Decode (T = 1) without the length-1 axis: with it XLA CPU transposes around both dots
    # (SmolLM-135M shape, B=16, 128 keys: 0.33 → 0.23 ms per layer).
    q = q if T > 1 else q[:, 0]
    attend = partial(_attend, q, positions, window, scale, softcap)
    # Block by block where a bucket of whole blocks holds keys past the queries: a prompt's chunk
    # or a speculative check. A fresh prompt in one call (T = kv_len) sees its whole bucket, where
    # the loop only costs (a 1024-token prompt: 2.6 → 2.9 s).
    if 1 < T < kv_len and kv_len > KEY_BLOCK and kv_len % KEY_BLOCK == 0:
        top, total, out = _blockwise(attend, read, positions, kv_len, window)
    else:
        top, total, out = attend(*read(0, kv_len), 0)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(KV, -1, *(1,) * (top.ndim - 3))  # [KV, G, (1)]
        total, out = with_sinks(top, total, out, sink)
    out = out / total[..., None]  # [B, KV, G, (T), hd]
    return jnp.moveaxis(out, 3, 1) if T > 1 else out


def _attend(
    q, q_pos, window, scale, softcap, keys, values, k_scale, v_scale, first
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries q [B, T, KV, G, hd] (decode: [B, KV, G, hd]) at q_pos [B, T] over the keys and values
    [B, S, KV, hd] at positions first… (int8: scales [B, S, KV]): the softmax's (max, sum) [B, KV,
    G, (T)] and its unnormalised weighted values [B, KV, G, (T), hd], float32. Normalising after
    the value product saves a pass over [.., T, S] (SmolLM-135M shape: a 64-token prefill chunk over
    4096 keys 437 → 364 ms, a 1024-token prompt's TTFT 1685 → 1261 ms; decode unchanged within noise)."""
    t = "t" if q.ndim == 5 else ""
    mask = attention_mask(q_pos, first + jnp.arange(keys.shape[1]), window)  # [B, T, S]
    mask = mask[:, None, None] if t else mask[:, None]

    def per_key(scale: jax.Array) -> jax.Array:
        """int8 K/V: a head's scale [B, S, KV] is constant along hd, so it multiplies the scores
        (K) and the attention weights (V) [b, k, g, (t), s] instead of dequantizing the cache."""
        return jnp.expand_dims(jnp.moveaxis(scale, 1, -1), (2, 3) if t else 2)

    scores = jnp.einsum(f"b{t}kgh,bskh->bkg{t}s", q, keys.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    if k_scale is not None:
        scores = scores * per_key(k_scale)
    if softcap:
        scores = soft_cap(scores, softcap)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    top = scores.max(-1)
    weights = jnp.exp(scores - top[..., None])
    total = weights.sum(-1)
    if v_scale is not None:
        weights = weights * per_key(v_scale)
    # Out as [b, k, g, t, h], moved after: "->btkgh" made XLA CPU's dot 2.3× slower (16 queries,
    # 4096 keys: 91 → 40 ms over 30 layers).
    out = jnp.einsum(
        f"bkg{t}s,bskh->bkg{t}h", weights.astype(q.dtype), values.astype(q.dtype), preferred_element_type=jnp.float32
    )
    return top, total, out


def with_sinks(top: jax.Array, total: jax.Array, out: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A running softmax's (max, sum, weighted values) with each head's sink logit joined to its sum
    (gpt-oss's attention sinks: `softmax([scores, sink])` whose sink column weighs nothing): (sum,
    weighted values), both rescaled to max(max, sink) so neither can overflow."""
    new = jnp.maximum(top, sink)
    kept = jnp.exp(top - new)
    return total * kept + jnp.exp(sink - new), out * kept[..., None]


def _blockwise(attend, read, q_pos: jax.Array, kv_len: int, window: int | None) -> tuple[jax.Array, ...]:
    """A prompt chunk's (or a speculative check's) attention a KEY_BLOCK of keys at a time (flash
    attention's running softmax), over only the blocks its queries can see: its program's kv bucket
    is a power of two, and a chunk at position 2500 of a 4096 bucket skips the last 1536 keys (and,
    under a sliding window, the blocks below it). The scores held at once are [T, KEY_BLOCK] per
    head, not [T, kv_len]. Returns (max, sum, weighted values)."""
    last = jnp.minimum(q_pos.max() // KEY_BLOCK + 1, kv_len // KEY_BLOCK)
    first = 0 if window is None else jnp.maximum(q_pos.min() - window + 1, 0) // KEY_BLOCK

    def block(j, carry):
        top, total, out = carry
        start = j * KEY_BLOCK
        here, here_total, here_out = attend(*read(start, KEY_BLOCK), start)
        new = jnp.maximum(top, here)
        before, now = jnp.exp(top - new), jnp.exp(here - new)
        return new, total * before + here_total * now, out * before[..., None] + here_out * now[..., None]

    shape = jax.eval_shape(attend, *read(0, KEY_BLOCK), 0)
    carry = (jnp.full(shape[0].shape, jnp.finfo(jnp.float32).min), jnp.zeros(shape[1].shape), jnp.zeros(shape[2].shape))
    return jax.lax.fori_loop(first, last, block, carry)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """Gemma 2's tanh soft-capping: x kept within ±cap, unchanged near 0."""
    return jnp.tanh(x / cap) * cap


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    kv_len: int,
    rows: jax.Array | None = None,
    rope_len: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Run tokens [B, T] at positions [B, T]; returns final hidden states [B, T, D] and the cache.

    Row b of the tokens belongs to cache row `rows[b]` (default: b; a batch engine prefills one
    slot of a larger cache). K/V of the new tokens are written into the cache first; queries attend
    over the first `kv_len` cache positions (static: the prompt bucket for a fresh prefill, the whole
    cache in decode). With no cache (training), tokens are a whole sequence at positions 0..T-1 and
    see only each other. `rope_len`: as `Block`'s.
    """
    (hidden,), cache = forward_blocks(params, cfg, [Block(tokens, positions, kv_len, rows, rope_len)], cache)
    return hidden, cache


def forward_blocks(
    params: Params, cfg: ModelConfig, blocks: list[Block], cache: KVCache | None
) -> tuple[list[jax.Array], KVCache | None]:
    """Several blocks of tokens, each of its own cache rows (no two blocks share one), in one pass
    over the weights: every matrix sees all their tokens at once, and only attention runs per block.
    A prompt chunk and the running rows' decode step ride together so (Sarathi's piggybacking): the
    step costs its attention and little else. Returns each block's hidden states [R, T, D]."""
    own_length = lambda b: b.positions + 1 if cache is not None else jnp.max(b.positions, axis=1, keepdims=True) + 1  # noqa: E731
    # once, not per layer
    blocks = [b if b.rope_len is not None else replace(b, rope_len=own_length(b)) for b in blocks]
    held = cache
    if cache is None and cfg.cached_layers != cfg.attention_layers:  # shared K/V need a place: the sequence's
        (block,) = blocks
        cache = KVCache.zeros(cfg, *block.tokens.shape, compute_dtype(params), whole=False)
        blocks = [replace(block, kv_len=block.tokens.shape[1])]
    tokens = jnp.concatenate([b.tokens.reshape(-1) for b in blocks])
    x = forms.take_rows(params["embed"], tokens, compute_dtype(params))  # [N, D]
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    x = scaled(x, cfg.embed_multiplier)
    per_layer = per_layer_inputs(params, tokens, x, cfg) if cfg.per_layer_input else None
    x, cache = (_altup_layers if cfg.altup_inputs else _layers)(params, cfg, x, per_layer, blocks, cache)
    cache = cache if held is not None else None
    x, hidden, at = rms_norm(x, params["norm"], cfg), [], 0
    for b in blocks:
        hidden.append(x[at : at + b.tokens.size].reshape(*b.tokens.shape, -1))
        at += b.tokens.size
    return hidden, cache


def _layers(params: Params, cfg: ModelConfig, x: jax.Array, per_layer, blocks, cache) -> tuple:
    """The layers over the residual stream x [N, D] (the embeddings): each its mixer and its
    feed-forward part added, Gemma 4's per-layer input gating a residual of its own. Returns the
    stream and the cache."""
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            h, cache = MIXERS[cfg.mixer(i)](layer, rms_norm(x, layer["attn_norm"], cfg), blocks, cache, i, cfg)
            h = rms_norm(h, layer["post_attn_norm"], cfg) if cfg.sandwich_norms else h
            x = x + scaled(h, cfg.residual_multiplier)
            h, picked = feed_forward(layer, x, i, cfg)
            x = x + scaled(h, cfg.residual_multiplier)
            if picked is not None and cache is not None:
                cache = cache.count_experts(picked)
            if per_layer is not None:  # Gemma 4: the layer's own input gates a residual of its own
                x = x + _per_layer_residual(layer, x, per_layer[:, i], cfg)
            if cfg.layer_scalar:
                x = x * layer["scalar"].astype(x.dtype)
    return x, cache


def _altup_layers(params: Params, cfg: ModelConfig, x: jax.Array, per_layer, blocks, cache) -> tuple:
    """Gemma 3n's layers over AltUp's streams [A, N, D] made of the embeddings x [N, D]
    (`jaxinfer.layers.altup`): each predicts the streams, runs attention (with LAuReL beside it) and
    the MLP on the active one, corrects the others by it, and adds its per-layer input's residual to
    the others. Returns the streams gathered into one [N, D], and the cache."""
    xs = altup.spread(params, x, cfg)
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            predictions = altup.predict(layer, xs, cfg)
            active = predictions[cfg.altup_active]
            normed = rms_norm(active, layer["attn_norm"], cfg)
            h, cache = MIXERS[cfg.mixer(i)](layer, normed, blocks, cache, i, cfg)
            x = (active + rms_norm(h, layer["post_attn_norm"], cfg) + altup.laurel(layer, normed, cfg)) * jnp.asarray(
                2**-0.5, active.dtype
            )
            h, _ = feed_forward(layer, x, i, cfg)
            xs = altup.correct(layer, predictions, x + h, cfg)
            first = xs[cfg.altup_active]
            if cfg.altup_correct_scale:
                first = first * layer["altup_scale"].astype(first.dtype)
            # to every stream but the first (transformers', whichever is active)
            xs = xs.at[1:].add(_per_layer_residual(layer, first, per_layer[:, i], cfg))
    return altup.gather(params, xs, cfg), cache


def _per_layer_residual(layer: dict, x: jax.Array, own: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 3n's and 4's residual of a layer's own input `own` [N, P] (its row of `per_layer_inputs`),
    gated by x [N, D]: normed(out(act(gate(x)) · own))."""
    h = ACTIVATIONS[cfg.activation](linear(x, layer, "ple_gate", cfg)) * own
    return rms_norm(linear(h, layer, "ple_out", cfg), layer["ple_norm"], cfg)


def per_layer_inputs(params: Params, tokens: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 4's per-layer embeddings of tokens [N] with embeddings x [N, D]: [N, L, P], each layer's
    row of the second table (times √P) and a projection of x (times D^-½, RMS-normalised), averaged
    (times 2^-½), as transformers' `project_per_layer_inputs`."""
    L, P = cfg.num_layers, cfg.per_layer_input
    own = jnp.take(params["ple_embed"], tokens, axis=0).astype(x.dtype) * jnp.asarray(P**0.5, x.dtype)
    projected = scaled(forms.matmul(x, params["wple_proj"], cfg.matmul_inputs == "bfloat16"), cfg.hidden_size**-0.5)
    projected = rms_norm(projected.reshape(-1, L, P), params["ple_norm"], cfg)
    return scaled(projected + own.reshape(-1, L, P), 2**-0.5)


def scaled(x: jax.Array, multiplier: float) -> jax.Array:
    """x times a Python float as torch multiplies a tensor by one (Granite's multipliers): in float32,
    rounded once to x's dtype; x itself where it is 1."""
    return x if multiplier == 1.0 else (x.astype(jnp.float32) * multiplier).astype(x.dtype)


def logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """hidden [..., D] → float32 logits [..., V] (tied embeddings when there is no lm_head)."""
    head = params.get("lm_head", params["embed"])
    out = forms.matmul(hidden, head, cfg.matmul_inputs == "bfloat16", jnp.float32)
    if cfg.logit_divisor != 1.0:
        out = out / cfg.logit_divisor
    return soft_cap(out, cfg.final_softcap) if cfg.final_softcap else out
