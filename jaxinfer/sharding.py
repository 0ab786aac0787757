"""Tensor parallelism: one model spread over a 1-D mesh of devices (axis "tensor").

Each weight's dimensions have logical names in the weight table (`config.Weight.axes`); here the
names whose size divides the mesh map onto its axis, the others stay whole on every device. That is
Megatron's split: q/k/v and gate/up by their outputs (heads, the MLP's hidden units), o and down by
their inputs, the embedding and the head by the vocabulary, and the KV cache by kv heads; a mixture's
experts each by its hidden units, as a dense MLP (never by expert: `splits`); a Gated DeltaNet's
rows and recurrent state by key heads. XLA's SPMD partitioner then runs each program on every device
over its shards and adds the sums across devices (after o and down, for the head's logits). Decode
reads 1/N of the weights and of the cache per device per step: N devices' bandwidth serves one token
stream.

What does not divide stays whole: a model whose kv heads do not divide N (MQA: one kv head) keeps the
whole cache on every device; Phi-3's fused q/k/v and gate/up rows (an even split would mix q with k);
a quantized matrix's dimension whose share is not whole blocks; matrices the CPU kernel runs
(`packed`, and `quant` on the CPU), whose custom call takes a whole matrix.

The parameters carry their mesh: `mesh_of(params)` is how `Slots` places its state beside them.

A mesh may span processes, on one host or several (`jaxinfer.processes`): an equal share of each
one's devices.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import kernel
from jaxinfer.config import ModelConfig, Weight, leaves_of
from jaxinfer.errors import JaxinferError
from jaxinfer.families import weight_table
from jaxinfer.forms import is_form
from jaxinfer.quant import BLOCK, GROUP
from jaxinfer.runtime import check_backend

AXIS = "tensor"


def default_devices(processes: int = 1) -> int:
    """One per process on the CPU (N CPU devices are N slices of the same cores), every device elsewhere."""
    return processes if check_backend() == "cpu" else jax.device_count()


def check_share(devices: int | None, processes: int | None) -> None:
    """Every process gives the mesh an equal share of its devices."""
    if devices is not None and processes is not None and devices % processes:
        raise JaxinferError(
            f"devices {devices}: not a multiple of the {processes} processes (each gives the mesh an equal share)",
            "devices",
        )


def device_mesh(devices: int | None, processes: int = 1) -> Mesh | None:
    """A mesh over `devices` devices (None: `default_devices`), an equal share from each of
    `processes` processes (`join`); None for one device.

    On the CPU, XLA makes one device per process unless asked for more before its backend starts:
    this asks, so call it before anything runs on JAX (the CLI does, first thing)."""
    check_share(devices, processes)
    if devices is not None and devices > processes:
        try:
            jax.config.update("jax_num_cpu_devices", devices // processes)  # read by the CPU backend only
        except RuntimeError:
            pass  # the backends have started: what they have is what there is
    backend = check_backend()
    devices = devices or default_devices(processes)
    share = devices // processes
    local = {p: [d for d in jax.devices() if d.process_index == p] for p in range(processes)}
    if share > min(len(held) for held in local.values()):
        have = len(local[0])
        hint = " (the CPU's devices are set when JAX starts: ask before anything else runs)" if backend == "cpu" else ""
        each = " in each process" if processes > 1 else ""
        raise JaxinferError(
            f"devices {devices}: JAX has {have} {backend} device{'s' if have > 1 else ''}{each} here{hint}", "devices"
        )
    chosen = [d for p in range(processes) for d in local[p][:share]]
    return Mesh(np.array(chosen), (AXIS,)) if devices > 1 else None


def mesh_of(params: dict) -> Mesh | None:
    """The mesh a parameter tree is spread over, or None on one device."""
    sharding = params["norm"].sharding
    return sharding.mesh if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1 else None


def splits(cfg: ModelConfig, axis: str | None, devices: int) -> bool:
    """Whether a mesh of `devices` splits this logical axis: one of those it can, whose count divides it."""
    counts = {
        "vocab": cfg.vocab_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "mlp": cfg.intermediate_size,
        "expert_mlp": cfg.expert_size,  # a mixture's expert's hidden units
        "delta_heads": cfg.delta_heads,  # a DeltaNet's key heads, each with the value heads it serves
    }
    # A mixture's stack splits inside each expert, by its hidden units (as vLLM's tensor parallelism
    # does), never by expert: a routed expert is a slice of its stack at an index the router picks in
    # the graph, and XLA's SPMD partitioner gathers a stack split by experts whole onto every device
    # before slicing it. The compiled decode program of a tiny Qwen3-MoE over 4 CPU devices, split by
    # experts, began with six all-gathers of whole [8, 64, 64] stacks, hoisted out of the decode loop:
    # each call held every expert on every device again (a shard more than whole), and each step read
    # the routed experts whole on each. Split inside them, it gathers none, each device reading its
    # quarter. A stack with gate and up fused in its rows (no such axis: `jaxinfer.families.moe.STACK`)
    # stays whole.
    return axis in counts and counts[axis] % devices == 0


def held_axes(cfg: ModelConfig, weight: Weight, quantized: bool, devices: int) -> tuple:
    """The logical axes a weight can split by as it is stored: the table's; for a matrix (or a stack
    of experts' matrices) quantized in blocks (16 outputs by 32 inputs), only those where each device
    gets whole blocks, and none where the CPU kernel runs it (its custom call takes whole matrices:
    XLA would gather them)."""
    if not quantized:
        return weight.axes
    if kernel.available():
        return (None,) * len(weight.axes)
    lead = len(weight.axes) - 2  # a stack's experts axis
    return weight.axes[:lead] + tuple(
        name if size % (block * devices) == 0 else None
        for name, size, block in zip(weight.axes[lead:], weight.shape[lead:], (GROUP, BLOCK))
    )


def weight_sharding(cfg: ModelConfig, axes: tuple, mesh: Mesh | None) -> NamedSharding | None:
    """Where a tensor with these logical axes goes (None: no mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, PartitionSpec(*(AXIS if splits(cfg, name, mesh.size) else None for name in axes)))


def param_shardings(cfg: ModelConfig, params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every leaf of a parameter tree (concrete or abstract) in any layout: each
    matrix's as its form stores the weight table's axes (`forms.Form.axes`: reversed when transposed,
    by blocks when quantized (`held_axes`), whole in the CPU kernel's packed form); norms and biases
    by the table's axes."""
    table = leaves_of(weight_table(cfg))

    def one(keys, leaf):
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys)
        weight = table[path]
        if not is_form(leaf):
            return weight_sharding(cfg, weight.axes, mesh)
        axes = leaf.axes(weight.axes, held_axes(cfg, weight, True, mesh.size))
        return jax.tree.map(lambda a: weight_sharding(cfg, a, mesh), axes, is_leaf=lambda a: isinstance(a, tuple))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_form)


def place(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """The tree spread over `mesh`; leaves already where they belong stay."""
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def kv_heads_split(heads: int, devices: int) -> bool:
    """Whether a cache group of `heads` kv heads is split by heads over `devices` (where they divide:
    Gemma 4's full layers can have fewer than its sliding ones); else whole on each device."""
    return heads % devices == 0


def cache_spec(array, devices: int) -> PartitionSpec:
    """K/V [L, B, S, KV, hd] of a group of layers and their scales [L, B, S, KV]: split by kv heads
    where `kv_heads_split` says."""
    return PartitionSpec(None, None, None, AXIS) if kv_heads_split(array.shape[3], devices) else PartitionSpec()


def delta_split(cfg: ModelConfig, devices: int) -> bool:
    """Whether a hybrid's DeltaNet layers, their weights' rows and their state, split over `devices`
    (by key heads, as its convolution's weight does: `jaxinfer.families.hybrid`); else whole on each."""
    conv = next((w for w in weight_table(cfg).values() if w.path[-1] == "conv"), None)
    return conv is not None and splits(cfg, conv.axes[0], devices)


def delta_specs(cfg: ModelConfig, devices: int) -> tuple[PartitionSpec, PartitionSpec]:
    """A hybrid's DeltaNet state, the convolution's [B, K-1, C] and the rule's [B, Hv, dk, dv]: split
    over its channels and heads where `delta_split` says, else whole."""
    if not delta_split(cfg, devices):
        return PartitionSpec(), PartitionSpec()
    return PartitionSpec(None, None, AXIS), PartitionSpec(None, AXIS)


def state_shardings(state, mesh: Mesh, cfg: ModelConfig, draft: ModelConfig | None = None):
    """The decode state's shardings (`state.DecodeState`, concrete or abstract) for a model of `cfg`
    (and its `draft`'s): the caches' K/V split by `cache_spec`, a hybrid's recurrent state by
    `delta_specs`, everything else (tokens, lengths, sampler settings: a few bytes a row) whole."""
    whole = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)

    def cache(c, cfg):
        split = jax.tree.map(lambda a: NamedSharding(mesh, cache_spec(a, mesh.size)), c.kv_only)
        conv, recurrent = (NamedSharding(mesh, spec) for spec in delta_specs(cfg, mesh.size))
        # every array of the state, now or kept: a convolution's [B, K-1, C] or a rule's [B, Hv, dk, dv]
        delta = jax.tree.map(lambda a: conv if a.ndim == 3 else recurrent, c.delta)
        read = None if c.experts_read is None else NamedSharding(mesh, PartitionSpec())
        return replace(split, delta=delta, experts_read=read)

    draft_cache = cache(state.draft_cache, draft) if state.draft_cache is not None else None
    return replace(whole, cache=cache(state.cache, cfg), draft_cache=draft_cache)


def bytes_per_device(params: dict) -> list[int]:
    """What each device of the tree's mesh holds of it, in bytes, by device."""
    held: dict = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return [held[d] for d in sorted(held, key=lambda d: d.id)]
