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

A mesh may span processes, on one host or several (`join`: jax.distributed). JAX then runs one copy
of the program per process, in step: each process must make the same calls with the same values.
The first reads the input and the others take it from there (`share`); what a host would choose by
itself, from its clock or at random, is the first's choice too (`agree`, `shared_seed`).
"""

from __future__ import annotations

import os
import pickle
import secrets
import sys
import threading
from dataclasses import replace
from typing import Callable, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.runtime import check_backend

AXIS = "tensor"
T = TypeVar("T")
JOIN_TIMEOUT_S = 120  # time for every process to start and reach the coordinator (a first import of JAX takes seconds)


def join(coordinator: str | None, processes: int | None, process_id: int | None, timeout_s: float = JOIN_TIMEOUT_S) -> int:
    """Join this process to the others of one run (`jax.distributed`): every process then sees every
    process's devices, and a mesh spans them. None leaves a value to JAX, which reads
    $JAX_COORDINATOR_ADDRESS and what SLURM, Open MPI or Kubernetes set. Returns the number of
    processes. Call it before anything runs on JAX; on the CPU the processes talk through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read by the CPU backend only
    joined = threading.Event()

    def give_up() -> None:
        # JAX aborts the process with a stack trace when a peer never comes (a C++ check, not an
        # exception): stop first, with the line a user needs.
        if not joined.wait(timeout_s):
            where = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "the coordinator")
            who = f"process {process_id} of {processes}: " if None not in (process_id, processes) else ""
            sys.stderr.write(
                f"error: {who}not every process joined at {where} within {timeout_s:.0f} s; "
                "start the others with the same --coordinator and --num-processes and each its own --process-id\n"
            )
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=give_up, daemon=True).start()
    try:
        jax.distributed.initialize(coordinator, processes, process_id, initialization_timeout=int(timeout_s) + 30)
    except (ValueError, TypeError) as e:  # what JAX could not find: the flags, or a cluster's variables
        raise JaxinferError(f"cannot join the processes: {e} (give --coordinator HOST:PORT, --num-processes and --process-id)") from None
    finally:
        joined.set()
    from jax._src.distributed import global_state  # the count, without starting a backend (jax.process_count would)

    return global_state.num_processes


def default_devices(processes: int = 1) -> int:
    """One per process on the CPU (N CPU devices are N slices of the same cores), every device elsewhere."""
    return processes if check_backend() == "cpu" else jax.device_count()


def check_share(devices: int | None, processes: int | None) -> None:
    """Every process gives the mesh an equal share of its devices."""
    if devices is not None and processes is not None and devices % processes:
        raise JaxinferError(f"--devices {devices}: not a multiple of the {processes} processes (each gives the mesh an equal share)")


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
        raise JaxinferError(f"--devices {devices}: JAX has {have} {backend} device{'s' if have > 1 else ''}{each} here{hint}")
    chosen = [d for p in range(processes) for d in local[p][:share]]
    return Mesh(np.array(chosen), (AXIS,)) if devices > 1 else None


def agree(value: int) -> int:
    """Process 0's value, in every process (one process: the value). For the choices a host makes
    from its clock (how many steps the next streamed chunk runs): all must run the same programs."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def share(produce: Callable[[], T]) -> T:
    """What `produce()` returns (or raises) in process 0, in every process; the others do not call
    it. For what only the first process reads (a prompt on its stdin, a job's file on its host)."""
    if jax.process_count() == 1:
        return produce()
    from jax.experimental import multihost_utils

    data = b""
    if jax.process_index() == 0:
        try:
            data = pickle.dumps((produce(), None))
        except (JaxinferError, EOFError, KeyboardInterrupt) as e:  # what a command reports, or the end of the input
            data = pickle.dumps((None, e))
    size = agree(len(data))
    padded = np.zeros(1 << (size - 1).bit_length(), np.uint8)  # whole powers of two: few programs compile
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    value, error = pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded))[:size].tobytes())
    if error is not None:
        raise error
    return value


def shared_seed() -> int:
    """A fresh random seed, the same in every process."""
    return agree(secrets.randbits(31))


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
