"""Process-wide JAX settings: the persistent compilation cache, and measuring what compiling costs."""

from __future__ import annotations

import errno
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxinfer.errors import JaxinferError

CACHE_ENV = "JAXINFER_CACHE_DIR"


def default_cache_dir() -> Path:
    """~/.cache/jaxinfer/xla (or under $XDG_CACHE_HOME); OSError where there is no home at all."""
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no $HOME and no passwd entry (a bare container user)
        raise FileNotFoundError(errno.ENOENT, "no home directory", "~") from None
    return Path(base) / "jaxinfer" / "xla"


def check_backend() -> str:
    """The JAX platform in use; one clear error where JAX_PLATFORMS asks for one this install or
    machine lacks (JAX itself fails later with an empty AssertionError)."""
    try:
        return jax.default_backend()
    except (RuntimeError, AssertionError) as e:
        raise JaxinferError(
            f"JAX cannot start the backend JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r} asks for"
            + (f" ({e})" if str(e) else "")
            + "; NVIDIA GPUs need the cuda12 or cuda13 extra and a driver, and JAX_PLATFORMS=cpu runs on the CPU"
        ) from None


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Persist compiled programs so a second identical run does not compile again.

    `path` (or $JAXINFER_CACHE_DIR) overrides the default; an empty string turns the cache off.
    Raises OSError where the directory cannot be made or written (a read-only home).
    """
    chosen = (os.environ[CACHE_ENV] if CACHE_ENV in os.environ else default_cache_dir()) if path is None else path
    if not str(chosen):
        return None
    directory = Path(chosen).expanduser().resolve()  # jax wants an absolute path
    directory.mkdir(parents=True, exist_ok=True)  # OSError: the caller runs without the cache
    if not os.access(directory, os.W_OK):
        raise PermissionError(errno.EACCES, "not writable", str(directory))
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache everything: our small programs compile in well under JAX's default 1 s threshold.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


@dataclass
class CompileReport:
    seconds: float = 0.0  # tracing + lowering + compiling (or reading the cache), set by the caller
    programs: int = 0  # programs XLA produced: compiled, or read back from the persistent cache
    cache_hits: int = 0  # of those, read back from the persistent cache

    def add(self, other: CompileReport) -> None:
        self.seconds += other.seconds
        self.programs += other.programs
        self.cache_hits += other.cache_hits

    @property
    def cache(self) -> str:
        """'hit' (all read back), 'miss' (some compiled), or 'none' (nothing needed building)."""
        if self.programs > self.cache_hits:
            return "miss"
        return "hit" if self.cache_hits else "none"


_local = threading.local()  # .reports: the reports of the watch blocks open in this thread
_listening = False


def _on_duration(name: str, seconds: float, **_) -> None:
    if name == "/jax/core/compile/backend_compile_duration":  # also recorded on a cache hit
        for report in getattr(_local, "reports", ()):
            report.programs += 1


def _on_event(name: str, **_) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        for report in getattr(_local, "reports", ()):
            report.cache_hits += 1


@contextmanager
def watch_compiles():
    """Count the programs compiled, or read from the persistent cache, in this block (this thread
    only; blocks may nest)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    report = CompileReport()
    _local.reports = [*getattr(_local, "reports", ()), report]
    try:
        yield report
    finally:
        _local.reports.remove(report)


@contextmanager
def interrupts_held():
    """Hold Ctrl-C until the block ends, then hand it to the handler it was held from (Python's
    raises KeyboardInterrupt; joined processes' defers it to their next stop point). A
    KeyboardInterrupt raised inside JAX's lowering or compiling leaves the process to crash
    (SIGSEGV) at exit; a compile takes seconds at most, so the user still gets their interrupt
    within a moment. Main thread only (signals are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import signal

    pending = []
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending and previous is not signal.SIG_IGN:
        if not callable(previous):  # SIG_DFL, set outside Python
            raise KeyboardInterrupt
        previous(signal.SIGINT, None)


def compile_ahead(fn, *args, **static):
    """(compiled program, its CompileReport): `fn` (a jitted function) lowered and compiled for these
    arguments before its first call, so that compile time is measured apart from run time (and read
    back from the persistent cache if there). Ctrl-C is held meanwhile."""
    with interrupts_held(), watch_compiles() as report:
        start = time.perf_counter()
        compiled = fn.lower(*args, **static).compile()
        report.seconds = time.perf_counter() - start
    return compiled, report


class Programs:
    """Compiled programs by key, each built ahead of its first use by `compile_ahead`; the cost of
    building one is added to the CompileReport the caller is accounting to."""

    def __init__(self):
        self._compiled: dict[tuple, object] = {}

    def get(self, key: tuple, report: CompileReport, fn, *args, **static):
        if key not in self._compiled:
            self._compiled[key], built = compile_ahead(fn, *args, **static)
            report.add(built)
        return self._compiled[key]
