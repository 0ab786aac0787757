"""A layer's feed-forward part, with the norms around it: the dense gated MLP, a mixture of experts (a
router, E experts of which each token takes k, and an optional shared expert with a sigmoid gate), or
Gemma 4's two side by side.

A mixture's leaves (`jaxinfer.families.moe`): "router" [E, D] (a plain array: never quantized or
packed, so the choice of experts is the checkpoint's to float32 rounding), the experts' stacks
"we_gate", "we_up" [E, F, D] and "we_down" [E, D, F] (`forms.Experts`), and for a shared expert the
dense MLP's "wgate"/"wup"/"wdown" and "shared_gate" [1, D]. gpt-oss's (`jaxinfer.families.gpt_oss`):
the router's bias "router_bias" [E], gate and up fused, "we_gate_up" [E, 2F, D], and each stack's
biases "be_gate_up" [E, 2F], "be_down" [E, D]. Gemma 4's (`jaxinfer.families.gemma4`): gate and up
fused, the router's own scale "router_scale" [D] and each expert's "expert_scale" [E], and norms
around the mixture ("mlp_norm_2", "post_mlp_norm_2") and the MLP beside it ("post_mlp_norm_1").

The experts' products read only the experts the tokens were routed to (`routed_mlp`), by one of
three plans chosen by shape (first measured on XLA CPU, a 2-core Zen 4, 64 experts of 384 × 1024
float32, top 8: one product of gate's shape for N rows):
- few (row, expert) pairs (decode at batch 1 and 2): each pair's MLP on its own, the expert read where
  it lies in its stack by the CPU kernels (elsewhere sliced): N = 1 0.9 ms sliced, where a gather of
  the 8 experts' weights (`w[ids]`) took 11 ms (XLA copies them) and the product over all 64 experts
  2.2 ms;
- more pairs on the CPU kernels: each product one call over all of them, which groups the rows by
  expert (ggml's `mul_mat_id`; `routed_kernels`);
- more pairs elsewhere: the pairs sorted by expert into tiles of one expert each (MegaBlocks'
  grouping), a loop over the tiles skipping empty ones: N = 256 33 ms, against 71 ms over all experts
  and 875 ms for `jax.lax.ragged_dot` (which XLA CPU expands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm as normal

from jaxinfer import forms
from jaxinfer.config import ModelConfig
from jaxinfer.layers.norm import rms_norm

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def linear(x: jax.Array, layer: dict, name: str, cfg: ModelConfig) -> jax.Array:
    """x [..., in] @ the matrix `w{name}` (in any form, `jaxinfer.forms`) + the bias `b{name}`, when the
    checkpoint has one."""
    y = forms.matmul(x, layer[f"w{name}"], cfg.matmul_inputs == "bfloat16")
    bias = layer.get(f"b{name}")
    return y if bias is None else y + bias


def gated(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A gated MLP's hidden units from its gate and up projections: act(gate) · up, or gpt-oss's
    clamped SwiGLU (`ModelConfig.activation`)."""
    if cfg.activation == "swiglu_clamped":
        gate, up = jnp.minimum(gate, cfg.swiglu_limit), jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    return ACTIVATIONS[cfg.activation](gate) * up


def dense(layer: dict, x: jax.Array, cfg: ModelConfig, sparsity: float = 0.0) -> jax.Array:
    """The gated MLP: down(act(gate(x)) · up(x)), x [N, D] → [N, D]; with a `sparsity` (Gemma 3n's
    first layers), only the gate units above that quantile of a normal fit to each row's survive,
    shifted down by it (transformers' `_gaussian_topk`)."""
    if "wgate_up" in layer:
        gate, up = jnp.split(linear(x, layer, "gate_up", cfg), 2, axis=-1)
    else:
        gate, up = linear(x, layer, "gate", cfg), linear(x, layer, "up", cfg)
    if sparsity:
        multiplier = normal.ppf(jnp.float32(sparsity)).astype(gate.dtype)
        cutoff = jnp.mean(gate, axis=-1, keepdims=True) + jnp.std(gate, axis=-1, keepdims=True) * multiplier
        gate = jax.nn.relu(gate - cutoff)
    return linear(gated(gate, up, cfg), layer, "down", cfg)


def route(layer: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The router's choice for tokens x [N, D]: expert ids [N, k] (int32) and their weights [N, k]
    (float32), as transformers picks them: a softmax over all experts' logits (plus the router's
    bias, gpt-oss's), the k largest, and renormalised to sum to 1 where the family does
    (`ModelConfig.norm_topk`; gpt-oss's softmax over the k largest logits is that). Gemma 4's router
    RMS-normalises x and scales it by its own scale and D^-½ first, and weighs each chosen expert by
    its scale after."""
    x = x.astype(jnp.float32)
    if "router_scale" in layer:
        x = rms_norm(x, None, cfg) * layer["router_scale"].astype(jnp.float32) * x.shape[-1] ** -0.5
    logits = jnp.einsum("nd,ed->ne", x, layer["router"].astype(jnp.float32))
    if "router_bias" in layer:
        logits = logits + layer["router_bias"].astype(jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.experts_per_token)
    if cfg.norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    if "expert_scale" in layer:
        weights = weights * layer["expert_scale"].astype(jnp.float32)[ids]
    return ids.astype(jnp.int32), weights


def mixture(
    layer: dict, x: jax.Array, cfg: ModelConfig, routed_by: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The mixture for tokens x [N, D] → [N, D]: each token's k experts, weighted, plus the shared
    expert where the family has one, gated by sigmoid(shared_gate · x); and how many distinct experts
    the tokens picked between them (those whose weights the pass reads). `routed_by`: what the router
    reads where it is not x (Gemma 4's: the residual stream, before the mixture's norm)."""
    ids, weights = route(layer, x if routed_by is None else routed_by, cfg)
    out = routed_mlp(layer, x, ids, weights, cfg)
    if cfg.shared_expert_size:
        gate = jax.nn.sigmoid(jnp.einsum("nd,od->no", x.astype(jnp.float32), layer["shared_gate"].astype(jnp.float32)))
        out = out + (gate * dense(layer, x, cfg).astype(jnp.float32))
    picked = jnp.zeros(cfg.num_experts, bool).at[ids.reshape(-1)].set(True).sum()
    return out.astype(x.dtype), picked


def feed_forward(layer: dict, x: jax.Array, i: int, cfg: ModelConfig) -> tuple[jax.Array, jax.Array | None]:
    """Layer i's feed-forward part on the residual stream x [N, D]: what it adds to it, and of a
    mixture the distinct experts the tokens picked (None: no experts). Its input normed
    ("mlp_norm"), and its output too in Gemma's sandwich ("post_mlp_norm"); Gemma 4's MLP and
    mixture beside it each with norms of their own, the mixture routed by the residual itself."""
    normed, picked = rms_norm(x, layer["mlp_norm"], cfg), None
    part = cfg.feed_forward(i)
    if part == "dense":
        h = dense(layer, normed, cfg, cfg.activation_sparsity[i] if cfg.activation_sparsity else 0.0)
    elif part == "mixture":
        h, picked = mixture(layer, normed, cfg)
    else:  # "dense and mixture"
        routed, picked = mixture(layer, rms_norm(x, layer["mlp_norm_2"], cfg), cfg, routed_by=x)
        h = rms_norm(dense(layer, normed, cfg), layer["post_mlp_norm_1"], cfg)
        h = h + rms_norm(routed, layer["post_mlp_norm_2"], cfg)
    return rms_norm(h, layer["post_mlp_norm"], cfg) if cfg.sandwich_norms else h, picked


# (row, expert) pairs up to which each pair runs on its own (decode at batch 1 and 2 with top 8).
PAIRS = 16


EXPERT_MATRICES = ("we_gate", "we_up", "we_gate_up", "we_down")  # gate and up apart, or fused (gpt-oss)


def expert_mlp(layer: dict, x: jax.Array, e: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The gated MLP of expert e (one for all rows, or one a row [T]) on rows x [T, D] → [T, D]
    float32: on the CPU kernels each expert read where it lies in its stack, elsewhere (one expert)
    its matrices sliced; gate and up one product where the stack holds them fused (its outputs all
    the gates, then all the ups), each product plus its expert's bias where there are biases."""
    bf16 = cfg.matmul_inputs == "bfloat16"

    def product(name: str, rows: jax.Array, dtype) -> jax.Array:
        if layer[name].on_kernel():
            y = layer[name].matmul_routed(rows, jnp.broadcast_to(e, rows.shape[:1]), bf16, dtype)
        else:
            y = forms.matmul(rows, layer[name].expert(e), bf16, dtype)
        bias = layer.get("b" + name[1:])  # [E, out]
        return y if bias is None else y + bias[e].astype(dtype)

    if "we_gate_up" in layer:
        gate, up = jnp.split(product("we_gate_up", x, x.dtype), 2, axis=-1)
    else:
        gate, up = product("we_gate", x, x.dtype), product("we_up", x, x.dtype)
    return product("we_down", gated(gate, up, cfg), jnp.float32)


def tile_rows(pairs: int, experts: int) -> int:
    """Rows a tile of one expert holds: about half the pairs an expert gets (a power of two, 4 to
    64), so a batch's few rows per expert are not padded to a prompt's many, and an expert's last
    tile pads less than a tile as large as its share would (a 512-token prompt of the scaled
    Qwen3-30B-A3B shape, 64 experts, top 8: tiles of 32 rows against 64 prefill ×1.21 float32, ×1.23
    bfloat16, ×1.32 q8_0, ×1.05 int4; BENCHMARKS.md, 2026-11-27 evening)."""
    return int(min(64, max(4, 1 << max(0, pairs // (2 * experts) - 1).bit_length())))


def routed_mlp(layer: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Σ_k weights[n, k] · expert ids[n, k]'s MLP (x[n]) → [N, D] float32, reading only routed experts.
    Up to `PAIRS` (row, expert) pairs (decode at batch 1 and 2), each pair's MLP on its own: the
    pairs' calls depend on none of each other's, and XLA runs them side by side (the scaled
    Qwen3-30B-A3B shape at batch 1, decode tok/s: int4 232–240 → 266–305, Q4_K_M 187–207 → 208–237
    against the three products of all the pairs in one call each). More pairs: on the CPU kernels each
    product one call over all of them (`routed_kernels`), elsewhere tiles of one expert (`routed_tiles`)."""
    if ids.size <= PAIRS:
        return routed_pairs(layer, x, ids, weights, cfg)
    if all(layer[name].on_kernel() for name in EXPERT_MATRICES if name in layer):
        return routed_kernels(layer, x, ids, weights, cfg)
    return routed_tiles(layer, x, ids, weights, cfg)


def routed_kernels(layer: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Each row once per expert it was routed to, the three products each one call over all the
    pairs (`forms.Experts.matmul_routed`: the kernel groups them by expert, exactly, with no padding;
    a batch of 16 rows 370 → 409 tok/s and a 128-token prompt 653 → 912 tok/s on the q8_0 GGUF of the
    scaled Qwen3-30B-A3B shape, against `routed_tiles` on the kernels)."""
    N, K = ids.shape
    out = expert_mlp(layer, jnp.repeat(x, K, axis=0), ids.reshape(-1), cfg)  # pair (n, k) at row n·K + k
    return (out.reshape(N, K, -1) * weights[..., None]).sum(1)


def routed_pairs(layer: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Each (row, expert) pair's MLP on its own: decode's few pairs."""
    N, K = ids.shape
    out = jnp.zeros((N, x.shape[-1]), jnp.float32)
    for j in range(N * K):
        n, k = divmod(j, K)
        out = out.at[n].add(weights[n, k] * expert_mlp(layer, x[n : n + 1], ids[n, k], cfg)[0])
    return out


def routed_tiles(layer: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The pairs sorted by expert into tiles of one expert each, a loop over the tiles skipping the
    empty ones: a batch's or a prompt's many pairs."""
    N, K = ids.shape
    P, E = N * K, cfg.num_experts
    T = tile_rows(P, E)
    tiles = -(-P // T) + E  # each expert's pairs padded to whole tiles: at most one partial tile each
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs by expert
    sizes = jnp.bincount(flat, length=E)
    padded = -(-sizes // T) * T
    ends = jnp.cumsum(padded)
    by_expert = flat[order]
    # [P]: the row of the tiles each sorted pair goes to (its expert's first row + its rank there)
    slot = (ends - padded)[by_expert] + jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[by_expert]
    rows = jnp.full((tiles * T,), N, jnp.int32).at[slot].set((order // K).astype(jnp.int32))  # row N: padding
    grouped = jnp.concatenate([x, jnp.zeros_like(x[:1])])[rows].reshape(tiles, T, -1)
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles) * T, side="right"), E - 1)
    used = jnp.arange(tiles) * T < ends[-1]

    def tile(t, out):
        def run(out):
            return jax.lax.dynamic_update_index_in_dim(out, expert_mlp(layer, grouped[t], tile_expert[t], cfg), t, 0)

        return jax.lax.cond(used[t], run, lambda out: out, out)

    y = jax.lax.fori_loop(0, tiles, tile, jnp.zeros((tiles, T, x.shape[-1]), jnp.float32)).reshape(tiles * T, -1)
    per_pair = jnp.zeros((P, x.shape[-1]), jnp.float32).at[order].set(y[slot])  # back in (row, k) order
    return (per_pair.reshape(N, K, -1) * weights[..., None]).sum(1)
