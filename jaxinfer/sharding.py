"""Tensor parallelism: one model spread over a 1-D mesh of devices (axis "tensor").

Each weight's dimensions have logical names in the weight table (`config.Weight.axes`); here the
names whose size divides the mesh map onto its axis, the others stay whole on every device. That is
Megatron's split: q/k/v and gate/up by their outputs (heads, the MLP's hidden units), o and down by
their inputs, the embedding and the head by the vocabulary, and the KV cache by kv heads. XLA's SPMD
partitioner then runs each program on every device over its shards and adds the sums across devices
(after o and down, for the head's logits). Decode reads 1/N of the weights and of the cache per
device per step: N devices' bandwidth serves one token stream.

What does not divide stays whole: a model whose kv heads do not divide N (MQA: one kv head) keeps the
whole cache on every device; Phi-3's fused q/k/v and gate/up rows (an even split would mix q with k);
matrices in the CPU kernel's forms (`packed`, `quant`), whose custom call runs on a whole matrix.

The parameters carry their mesh: `mesh_of(params)` is how `Slots` places its state beside them.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.runtime import check_backend

AXIS = "tensor"


def default_devices() -> int:
    """1 on the CPU (N CPU devices are N slices of the same cores), every local device elsewhere."""
    return 1 if check_backend() == "cpu" else jax.local_device_count()


def device_mesh(devices: int | None) -> Mesh | None:
    """A mesh over the first `devices` devices (None: `default_devices`); None for one device.

    On the CPU, XLA makes one device unless asked for more before its backend starts: this asks,
    so call it before anything runs on JAX (the CLI does, first thing)."""
    if devices is not None and devices > 1:
        try:
            jax.config.update("jax_num_cpu_devices", devices)  # read by the CPU backend only
        except RuntimeError:
            pass  # the backends have started: what they have is what there is
    backend = check_backend()
    devices = devices or default_devices()
    there = jax.devices()
    if devices > len(there):
        hint = " (the CPU's devices are set when JAX starts: ask before anything else runs)" if backend == "cpu" else ""
        raise JaxinferError(f"--devices {devices}: JAX has {len(there)} {backend} device{'s' if len(there) > 1 else ''} here{hint}")
    return Mesh(np.array(there[:devices]), (AXIS,)) if devices > 1 else None


def mesh_of(params: dict) -> Mesh | None:
    """The mesh a parameter tree is spread over, or None on one device."""
    sharding = params["norm"].sharding
    return sharding.mesh if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1 else None


def splits(cfg: ModelConfig, axis: str | None, devices: int) -> bool:
    """Whether a mesh of `devices` splits this logical axis: one of those it can, whose count divides it."""
    counts = {"vocab": cfg.vocab_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size}
    return axis in counts and counts[axis] % devices == 0


def weight_sharding(cfg: ModelConfig, axes: tuple, mesh: Mesh | None) -> NamedSharding | None:
    """Where a tensor with these logical axes goes (None: no mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, PartitionSpec(*(AXIS if splits(cfg, name, mesh.size) else None for name in axes)))


def param_shardings(cfg: ModelConfig, params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every leaf of a parameter tree (concrete or abstract) in any layout: the
    weight table's axes for the matrices as stored ([out, in], or reversed for `_io`), whole for
    everything the table does not name (the kernel's packed and quantized forms)."""
    from jaxinfer.weights import weight_table

    axes = {w.path: w.axes for w in weight_table(cfg).values()}

    def one(keys, leaf) -> NamedSharding:
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys)
        named = axes.get(path)
        if named is None and isinstance(path[-1], str) and path[-1].endswith("_io"):
            named = axes.get((*path[:-1], path[-1][: -len("_io")]), ())[::-1]
        return weight_sharding(cfg, named or (), mesh)

    return jax.tree_util.tree_map_with_path(one, params)


def place(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """The tree spread over `mesh`; leaves already where they belong stay."""
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def cache_spec(cfg: ModelConfig, devices: int) -> PartitionSpec:
    """K/V [L, B, S, KV, hd] and their scales [L, B, S, KV]: split by kv heads where they divide."""
    return PartitionSpec(None, None, None, AXIS) if splits(cfg, "kv_heads", devices) else PartitionSpec()


def state_shardings(state, cfg: ModelConfig, mesh: Mesh, draft: ModelConfig | None = None):
    """The decode state's shardings (`decode.DecodeState`, concrete or abstract): the caches split
    by `cache_spec`, everything else (tokens, lengths, sampler settings: a few bytes a row) whole."""
    whole = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
    cache = lambda c, cfg: jax.tree.map(lambda _: NamedSharding(mesh, cache_spec(cfg, mesh.size)), c)  # noqa: E731
    draft_cache = cache(state.draft_cache, draft) if state.draft_cache is not None else None
    return replace(whole, cache=cache(state.cache, cfg), draft_cache=draft_cache)


def bytes_per_device(params: dict) -> list[int]:
    """What each device of the tree's mesh holds of it, in bytes, by device."""
    held: dict = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return [held[d] for d in sorted(held, key=lambda d: d.id)]
