"""What each phase must compute and move, from the config alone, and how close a run came to the
machine's limits.

Prefill pushes many tokens through every weight at once: high arithmetic intensity, compute-bound, so
its figure of merit is MFU (achieved FLOP/s over the peak). A decode step pushes one token per row
through every weight and reads the whole KV cache: intensity near 1 FLOP/byte at batch 1,
bandwidth-bound, so its figure of merit is MBU (achieved bytes/s over the peak).

Counted: matmuls at 2 FLOPs per multiply-add (projections, MLP, the LM head for the positions that
are sampled) and attention (QKᵀ and PV over the keys attended); bytes of every weight read once per
pass, and of the K/V read and written. Norms, RoPE and softmax are left out: a few percent at most
(tests/test_roofline.py holds this against XLA's own cost analysis of the compiled programs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxinfer import forms
from jaxinfer.config import ModelConfig, Weight, leaves_of, stored_methods
from jaxinfer.families import weight_table
from jaxinfer.layers import delta_net
from jaxinfer.quant import METHODS
from jaxinfer.sharding import delta_split, held_axes, kv_heads_split, splits
from jaxinfer.weights import quantized_here


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class Storage:
    """How the model is stored, as bytes per value: matrices in `itemsize`, or packed by `quantize`
    where they fit the packing, or each by its own method (`methods`: (path, method) pairs, a GGUF
    file's mix); norms, biases and the KV cache in the compute dtype's `cache_itemsize` (default:
    `itemsize`)."""

    itemsize: int = 4
    quantize: str | None = None
    cache_itemsize: int | None = None
    methods: tuple = ()

    @classmethod
    def of(
        cls, dtype, quantize: str | None = None, compute_dtype=None, cfg: ModelConfig | None = None, methods=None
    ) -> Storage:
        """As a model would be loaded in `dtype` with `quantize`; `cfg`: and with the matrices its
        checkpoint holds quantized itself (the hub's MXFP4 experts of gpt-oss) as they are; `methods`:
        each quantized matrix's method by path, where the model says (a GGUF file's, a converted one's)."""
        made = cls(np.dtype(dtype).itemsize, quantize, np.dtype(compute_dtype or dtype).itemsize)
        if methods:
            return replace(made, methods=tuple(sorted(methods.items())))
        table = weight_table(cfg) if cfg is not None else {}
        fixed = stored_methods(table)
        if not fixed:
            return made
        chosen = {".".join(map(str, p)): quantize for p, w in leaves_of(table).items() if made.method_at(p, w.shape)}
        return replace(made, methods=tuple(sorted({**chosen, **fixed}.items())))

    @classmethod
    def of_params(cls, params: dict) -> Storage:
        """As a loaded parameter tree stores its weights (the cache is in the compute dtype, the final
        norm's), each quantized matrix by its own method (a GGUF file's mix; MXFP4 experts beside float
        matrices)."""
        itemsize = np.dtype(forms.stored_dtype(params)).itemsize
        methods = tuple(sorted(forms.methods_of(params).items()))
        return cls(itemsize, forms.quantized_by(params), params["norm"].dtype.itemsize, methods)

    def method_at(self, path: tuple, shape: tuple[int, ...]) -> str | None:
        """The method the matrix at `path` is packed by, if any."""
        if self.methods:
            return dict(self.methods).get(".".join(map(str, path)))
        return self.quantize if self.quantize and quantized_here(path, shape) else None

    def bytes_per_value(self, path: tuple, shape: tuple[int, ...]) -> float:
        if method := self.method_at(path, shape):
            return METHODS[method].bytes_per_value
        return self.itemsize if len(shape) == 2 else (self.cache_itemsize or self.itemsize)


def expert_share(cfg: ModelConfig, tokens: int | None = None, read: float | None = None) -> float:
    """The share of a mixture's experts that `tokens` tokens read between them, each picking
    `experts_per_token` of `num_experts` and spread evenly over them (1 - (1 - k/E)^tokens: the
    roofline's estimate); `read`: the distinct experts a pass read over all its mixtures, as counted
    (`KVCache.experts_read`); None for both: the share one token computes with, k/E. 1 without experts."""
    if not cfg.num_experts:
        return 1.0
    if read is not None:
        return read / (cfg.num_experts * len(cfg.mixture_layers))
    picked = cfg.experts_per_token / cfg.num_experts
    return picked if tokens is None else 1.0 - (1.0 - picked) ** tokens


def _sizes(cfg: ModelConfig, storage: Storage | None = None, share: float = 1.0) -> tuple[float, float, float]:
    """(the layers' matrices, the LM head, everything else: embedding, norms, biases, routers) in
    parameters, or in bytes as `storage` stores them; of a mixture's experts, `share` of them."""
    layer_matrices = head = other = 0.0
    embed_per_value = 1.0
    for weight in leaves_of(weight_table(cfg)).values():
        path, shape = weight.path, weight.shape
        n = int(np.prod(shape)) * (storage.bytes_per_value(path, shape) if storage else 1)
        if weight.of_experts:
            layer_matrices += n * share
        elif path[0] == "layers" and len(shape) == 2 and path[-1] != "router":
            layer_matrices += n
        elif path[0] == "lm_head":
            head += n
        else:
            other += n
        if path == ("embed",):
            embed_per_value = n / int(np.prod(shape))
    if cfg.tie_word_embeddings:
        head = cfg.vocab_size * cfg.hidden_size * embed_per_value  # the embedding, read again as the head
    return layer_matrices, head, other


def parameter_count(cfg: ModelConfig, active: bool = False) -> int:
    """The parameters; `active`: those one token computes with (a mixture's k experts of E)."""
    share = expert_share(cfg) if active else 1.0
    leaves = leaves_of(weight_table(cfg)).values()
    return round(sum(int(np.prod(w.shape)) * (share if w.of_experts else 1.0) for w in leaves))


def weight_bytes(cfg: ModelConfig, storage: Storage, devices: int = 1) -> int:
    """The weights' size in memory as `storage` stores them; over a mesh of `devices`, what each
    device holds (`jaxinfer.sharding`: a tensor splits where one of its axes does)."""

    def held(weight: Weight) -> float:
        quantized = storage.method_at(weight.path, weight.shape) is not None
        split = any(splits(cfg, axis, devices) for axis in held_axes(cfg, weight, quantized, devices))
        return (
            int(np.prod(weight.shape)) * storage.bytes_per_value(weight.path, weight.shape) / (devices if split else 1)
        )

    return round(sum(held(weight) for weight in leaves_of(weight_table(cfg)).values()))


def kv_bytes_per_token(cfg: ModelConfig, storage: Storage, devices: int = 1) -> int:
    """K and V of one position: in the compute dtype, bfloat16, or int8 with a float32 scale per head
    (`cfg.kv_dtype`); over a mesh of `devices`, what each device holds (split by kv heads where they divide)."""
    itemsize = 2 if cfg.kv_dtype == "bfloat16" else storage.cache_itemsize or storage.itemsize

    def layer(i: int) -> int:
        hd, heads = cfg.head_dim_of(i), cfg.kv_heads_of(i)
        split = kv_heads_split(heads, devices)
        return 2 * (heads // devices if split else heads) * (hd + 4 if cfg.kv_dtype == "int8" else hd * itemsize)

    return sum(layer(i) for i in cfg.cached_layers)  # a layer sharing another's K/V holds none


def state_bytes_per_row(cfg: ModelConfig, storage: Storage, devices: int = 1) -> int:
    """What a hybrid's row holds of its DeltaNet layers' state, whatever the context: the state now
    and each one it keeps (`delta_net.SNAPSHOTS`); 0 without such layers. Over a mesh of `devices`,
    what each device holds (split by key heads where `delta_split` says)."""
    copies = 1 + len(delta_net.SNAPSHOTS)
    held = copies * delta_net.state_bytes(cfg, storage.cache_itemsize or storage.itemsize)
    return held // devices if delta_split(cfg, devices) else held


def _attention_flops(cfg: ModelConfig, queries: int, keys: int) -> float:
    """Attention's scores and weighted values, and a DeltaNet layer's work per token: within its
    chunk (`delta_net.CHUNK`, about as attention over that many keys) and against its state (read,
    updated, read again: 3 products of [dk, dv] per value head)."""
    attention = 4.0 * queries * keys * cfg.num_heads * sum(cfg.head_dim_of(i) for i in cfg.attention_layers)
    within = min(queries, delta_net.CHUNK) * (cfg.delta_key_dim + cfg.delta_value_dim)
    per_head = 2.0 * within + 6.0 * cfg.delta_key_dim * cfg.delta_value_dim
    return attention + queries * per_head * cfg.delta_value_heads * len(delta_net.delta_layers(cfg))


def _weight_bytes_read(cfg: ModelConfig, storage: Storage, tokens: int, experts: float | None = None) -> float:
    """Every matrix once (of a mixture's experts, those the tokens route to: `expert_share`, counted
    where `experts` is given); of the embedding only the rows looked up (unless it is also the head),
    of Gemma 4's per-layer embeddings likewise."""
    layer_matrices, head, other = _sizes(cfg, storage, expert_share(cfg, tokens, experts))
    embed_shape = (cfg.vocab_size, cfg.hidden_size)
    row = cfg.hidden_size * storage.bytes_per_value(("embed",), embed_shape)
    rows = 0 if cfg.tie_word_embeddings else min(tokens, cfg.vocab_size) * row
    norms = other - cfg.vocab_size * row
    if cfg.per_layer_input:
        ple_shape = (cfg.per_layer_vocab, cfg.num_layers * cfg.per_layer_input)
        ple_row = ple_shape[1] * storage.bytes_per_value(("ple_embed",), ple_shape)
        norms -= (cfg.per_layer_vocab - min(tokens, cfg.per_layer_vocab)) * ple_row  # the rows not looked up
    return layer_matrices + head + norms + rows


def prefill_cost(cfg: ModelConfig, storage: Storage, tokens: int, kv_len: int | None = None, batch: int = 1) -> Cost:
    """One prefill of `tokens` positions per row attending over `kv_len` keys (default: themselves),
    sampling the last position."""
    layer_matrices, head, _ = _sizes(cfg, share=expert_share(cfg))
    kv_len = tokens if kv_len is None else kv_len
    flops = batch * (2.0 * tokens * layer_matrices + 2.0 * head + _attention_flops(cfg, tokens, kv_len))
    kv = batch * kv_bytes_per_token(cfg, storage) * (tokens + kv_len)  # written, then read by attention
    return Cost(flops, _weight_bytes_read(cfg, storage, batch * tokens) + kv)


def decode_step_cost(
    cfg: ModelConfig, storage: Storage, kv_len: int, batch: int = 1, experts: float | None = None
) -> Cost:
    """One decode step: one token per row, attending over `kv_len` cached positions; of a mixture's
    experts, those `experts` says the step read (its distinct experts over all its mixtures, as
    counted: `KVCache.experts_read`), else even routing's estimate for `batch` tokens."""
    layer_matrices, head, _ = _sizes(cfg, share=expert_share(cfg))
    flops = batch * (2.0 * (layer_matrices + head) + _attention_flops(cfg, 1, kv_len))
    kv = batch * kv_bytes_per_token(cfg, storage) * (kv_len + 1)
    kv += batch * 2 * delta_net.state_bytes(cfg, storage.cache_itemsize or storage.itemsize)  # read and written
    return Cost(flops, _weight_bytes_read(cfg, storage, batch, experts) + kv)


def phase_report(cost: Cost, seconds: float, peak_flops: float, peak_bandwidth: float) -> dict:
    """Achieved rates of a phase that did `cost` in `seconds`, against the machine's ceilings."""
    balance = peak_flops / peak_bandwidth  # intensity where the two roofs meet
    flop_s, bytes_s = (cost.flops / seconds, cost.bytes / seconds) if seconds > 0 else (0.0, 0.0)
    return {
        "flops": cost.flops,
        "bytes": cost.bytes,
        "flop_s": flop_s,
        "bytes_s": bytes_s,
        "intensity": cost.intensity,
        "mfu": flop_s / peak_flops,
        "mbu": bytes_s / peak_bandwidth,
        "bound": "compute" if cost.intensity >= balance else "memory",
    }


def generation_report(cfg: ModelConfig, storage: Storage, timings, ceilings) -> dict:
    """Both phases of one generation (engine `Timings`) against the machine's `Ceilings`. Decode
    counts the K/V its steps read (`KVCache.positions_read`: the mean over the steps, as cost is
    linear in it), and a mixture's experts as its passes counted them (`Timings.experts_read`). A
    speculating loop reads the weights once per pass, not per token: its bytes count passes, its
    FLOPs the tokens made."""
    prompt, steps = timings.prompt_tokens, timings.generated_tokens - 1
    passes = timings.speculation.passes if timings.speculation else steps
    prefill = prefill_cost(cfg, storage, timings.prefilled_tokens, kv_len=prompt)
    kv_len = round(timings.kv_read / passes) if passes else prompt
    step = decode_step_cost(cfg, storage, kv_len, experts=timings.experts_a_pass)
    decode = Cost(step.flops * steps, step.bytes * passes)
    roofs = (ceilings.peak_flops, ceilings.peak_bandwidth)
    return {
        "peak_flops": ceilings.peak_flops,
        "peak_bandwidth": ceilings.peak_bandwidth,
        "method": ceilings.method,
        "prefill": phase_report(prefill, timings.ttft_s, *roofs),
        "decode": phase_report(decode, timings.decode_s, *roofs),
    }


def predicted_seconds(cost: Cost, peak_flops: float, peak_bandwidth: float) -> float:
    """The roofline's time for a phase: the slower of computing it and moving its bytes."""
    return max(cost.flops / peak_flops, cost.bytes / peak_bandwidth)


def model_facts(
    cfg: ModelConfig,
    storage: Storage,
    context: int,
    batch: int,
    prompt_tokens: int,
    ceilings,
    memory_bytes: int,
    devices: int = 1,
    shared_memory: bool = False,
) -> dict:
    """Sizes, memory for a context and batch, the longest context that fits, and the roofline's
    TTFT and ITL: what `jaxinfer info` shows, from the config alone. Over `devices`, what each holds
    and fits in `memory_bytes`, its own (GPUs) or, `shared_memory`, all of theirs (the CPU's devices)."""
    params = parameter_count(cfg)
    weights = weight_bytes(cfg, storage)
    kv_token = kv_bytes_per_token(cfg, storage)
    weights_each, kv_each = weight_bytes(cfg, storage, devices), kv_bytes_per_token(cfg, storage, devices)
    state_row, state_each = state_bytes_per_row(cfg, storage), state_bytes_per_row(cfg, storage, devices)
    holders = devices if shared_memory else 1  # the devices whose shards count against memory_bytes
    roofs = (ceilings.peak_flops, ceilings.peak_bandwidth)
    ttft = predicted_seconds(prefill_cost(cfg, storage, prompt_tokens, batch=batch), *roofs)
    itl = predicted_seconds(decode_step_cost(cfg, storage, context, batch), *roofs)
    forms = {
        "float32": Storage(4),
        "bfloat16": Storage(2),
        "int8": Storage(storage.itemsize, "int8"),
        "int4": Storage(storage.itemsize, "int4"),
    }
    return {
        "parameters": params,
        "active_parameters": parameter_count(cfg, active=True),
        "weight_bytes": {name: weight_bytes(cfg, form) for name, form in forms.items()},
        "stored_weight_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "state_bytes_per_row": state_row,
        "context": context,
        "batch": batch,
        "kv_cache_bytes": kv_token * context * batch,
        "total_bytes": weights + (kv_token * context + state_row) * batch,
        "devices": devices,
        "weight_bytes_per_device": weights_each,
        "kv_bytes_per_token_per_device": kv_each,
        "device_memory_bytes": memory_bytes,
        "longest_context_that_fits": max(
            0, (memory_bytes - holders * (weights_each + state_each * batch)) // (holders * kv_each * batch)
        ),
        "max_position_embeddings": cfg.max_position_embeddings,
        "peak_flops": ceilings.peak_flops,
        "peak_bandwidth": ceilings.peak_bandwidth,
        "method": ceilings.method,
        "predicted_ttft_s": ttft,
        "prompt_tokens": prompt_tokens,
        "predicted_itl_s": itl,
    }
