"""Several processes, on one host or several, as one run (`jax.distributed`).

JAX runs one copy of the program in each process, in step: every process must make the same calls
with the same values, and a mesh spans all their devices (`sharding.device_mesh`). The first process
reads the input and the others take it from there (`share`); what a host would choose by itself,
from its clock or at random, is the first's choice too (`agree`, `shared_seed`); a Ctrl-C in the
first stops them all at the next chunk (`stop_point`). In one process each of these is a no-op.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import jax
import numpy as np

from jaxinfer.errors import JaxinferError

T = TypeVar("T")
JOIN_TIMEOUT_S = 120  # time for every process to start and reach the coordinator (a first import of JAX takes seconds)


def join(
    coordinator: str | None, processes: int | None, process_id: int | None, timeout_s: float = JOIN_TIMEOUT_S
) -> int:
    """Join this process to the others of one run (`jax.distributed`): every process then sees every
    process's devices, and a mesh spans them. None leaves a value to JAX, which reads
    $JAX_COORDINATOR_ADDRESS and what SLURM, Open MPI or Kubernetes set. Returns the number of
    processes. Call it before anything runs on JAX; on the CPU the processes talk through gloo.

    JAX waits for the others in C++, where neither Ctrl-C nor its own timeout reaches Python (it
    aborts the process with a stack trace): the wait is a thread's, and this one gives up first."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read by the CPU backend only
    joined, failed = threading.Event(), []

    def connect() -> None:
        try:
            jax.distributed.initialize(coordinator, processes, process_id, initialization_timeout=int(timeout_s) + 30)
        except (ValueError, TypeError) as e:  # what JAX could not find: the flags, or a cluster's variables
            failed.append(
                JaxinferError(
                    f"cannot join the processes: {e} (give coordinator HOST:PORT, num_processes and process_id)",
                    "coordinator",
                    "num_processes",
                    "process_id",
                )
            )
        except Exception as e:  # raised in the caller's thread, as it would have been
            failed.append(e)
        finally:
            joined.set()

    threading.Thread(target=connect, daemon=True).start()
    try:
        if not joined.wait(timeout_s):
            where = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "the coordinator")
            who = f"process {process_id} of {processes}: " if None not in (process_id, processes) else ""
            _leave(
                1,
                f"error: {who}not every process joined at {where} within {timeout_s:.0f} s; "
                "start the others with the same coordinator address and process count, each with its own number",
            )
    except KeyboardInterrupt:
        _leave(130)
    if failed:
        raise failed[0]
    global _deferred
    _deferred = True  # from here on a Ctrl-C stops every process at the next stop_point
    signal.signal(signal.SIGINT, _on_interrupt)
    from jax._src.distributed import global_state  # the count, without starting a backend (jax.process_count would)

    return global_state.num_processes


def _leave(code: int, message: str = "") -> None:
    """Exit now, skipping JAX's exit, which would wait for the other processes (up to 5 minutes)."""
    sys.stdout.flush()
    if message:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(code)


def agree(value: int) -> int:
    """Process 0's value, in every process (one process: the value). For the choices a host makes
    from its clock (how many steps the next streamed chunk runs): all must run the same programs."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


_interrupted = threading.Event()
_deferred = False  # whether Ctrl-C waits for a `stop_point` (joined processes: they run in step)


def _on_interrupt(signum, frame) -> None:
    if not _deferred:
        raise KeyboardInterrupt
    if _interrupted.is_set():  # a second Ctrl-C: this process, now
        _leave(130)
    _interrupted.set()
    if jax.process_index() == 0:
        sys.stderr.write("stopping every process at the next chunk (Ctrl-C again: this one, now)\n")


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C raises at once within, as it does in one process (`share`: nothing runs in step while
    the first process reads its input)."""
    global _deferred
    before, _deferred = _deferred, False
    _interrupted.clear()  # one that came after the last stop point is spent
    try:
        yield
    finally:
        _deferred = before


def stop_point() -> None:
    """Where every process learns whether the first was interrupted, and raises KeyboardInterrupt
    if so, all at the same point. A Ctrl-C raised anywhere else would leave the others waiting in a
    collective it never joins (until JAX's heartbeat aborts them); one process: nothing to do."""
    if agree(int(_interrupted.is_set())):
        _interrupted.clear()
        raise KeyboardInterrupt


def share(produce: Callable[[], T]) -> T:
    """What `produce()` returns (or raises) in process 0, in every process; the others do not call
    it. For what only the first process reads (a prompt on its stdin, a job's file on its host)."""
    if jax.process_count() == 1:
        return produce()
    from jax.experimental import multihost_utils

    data = b""
    if jax.process_index() == 0:
        try:
            with _interruptible():  # waiting for input: a Ctrl-C is shared like any answer
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
