"""The shapes compiled programs run at, and what must fit them: prompt and kv buckets, prefill
chunks, a held prefix worth reusing, and the checks that a request fits the context and a cache the
device's memory (every driver's, before it admits a row: `Slots`, `Engine`, `Scheduler`, the API).

Both phases attend over a power-of-two prefix of the cache (a *kv bucket*) that covers the longest
live row, never over the whole `max_context`: decode is bandwidth-bound and, on small models, the
cache read costs more than the weights (SmolLM-135M shape: decode at `-c 8192` ran at 0.18× the
speed of `-c 256` before this). Shapes stay static: one decode program per kv bucket, compiled when
a row first crosses into it, and a decode call never runs a row past its bucket (the host caps its
traced step count), so the next call picks the next bucket.
"""

from __future__ import annotations

import math

import numpy as np

from jaxinfer.ceilings import device_memory_bytes
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.roofline import Storage, kv_bytes_per_token, state_bytes_per_row
from jaxinfer.runtime import check_backend

MIN_BUCKET = 16  # shortest padded prompt
MIN_KV_BUCKET = 128  # shortest kv prefix: below it the cache read is lost in the weights' (and programs cost compiles)
PREFILL_CHUNK = 128  # prompt tokens per prefill call where XLA attends (measured: docs/design.md, "Chunked prefill")
PREFILL_CHUNK_KERNEL = 512  # where the CPU attention kernel does: 15–19% faster alone than 128, 1024 no faster
# On an accelerator a prompt up to this long goes in one pass, whose attention is fused (`model.flash`):
# the 8B shape on an H100 prefilled 2048 tokens at 4,363 tok/s in chunks of 128, 11,335 in one pass
# (before the fused attention); 4096 bounds a pass's activations.
PREFILL_CHUNK_ACCELERATOR = 4096


def _pow2_bucket(n: int, smallest: int, largest: int) -> int:
    return min(max(smallest, 1 << math.ceil(math.log2(max(n, 1)))), largest)


def prompt_bucket(n: int, max_context: int) -> int:
    """Padded prompt length: the next power of two (≥ 16), capped by the cache, so prompts of
    many lengths share one compiled prefill."""
    return _pow2_bucket(n, MIN_BUCKET, max_context)


def kv_bucket(n: int, max_context: int) -> int:
    """Cache positions attended by a program whose queries sit below position n."""
    return _pow2_bucket(n, MIN_KV_BUCKET, max_context)


def chunk_size(n: int) -> int:
    """The prefill chunk for `--prefill-chunk n`: a power of two (rounded down; every chunk but a
    prompt's last fills its bucket exactly), at least MIN_BUCKET; 0 means no chunking."""
    return 0 if n <= 0 else 1 << (max(n, MIN_BUCKET).bit_length() - 1)


def check_memory(
    cfg: ModelConfig, storage: Storage, batch: int, max_context: int, draft: tuple[ModelConfig, Storage] | None, mesh
) -> None:
    """Refuse a cache the device cannot hold before allocating it (XLA would try, and fail or swap).
    Over a mesh, each device's share against its memory; the CPU's devices share one memory."""
    devices = mesh.size if mesh else 1
    holders = len(mesh.local_devices) if mesh and check_backend() == "cpu" else 1
    kv = kv_bytes_per_token(cfg, storage, devices) + (kv_bytes_per_token(*draft, devices) if draft else 0)
    per_position = batch * (kv + 4) * holders  # K and V, the tokens
    state = state_bytes_per_row(cfg, storage, devices) + (state_bytes_per_row(*draft, devices) if draft else 0)
    free = device_memory_bytes(free=True) - batch * holders * state
    if per_position * max_context > free:
        raise JaxinferError(
            f"a {max_context}-position cache for {batch} rows needs {per_position * max_context / 2**30:.1f} GiB, and "
            f"{free / 2**30:.1f} GiB is free: the longest context that fits is {free // per_position} positions"
        )


MIN_REUSE = MIN_BUCKET  # a shorter held prefix saves less than a second prefill program costs


def common_prefix(prompt: list[int], tokens) -> int:
    """How many leading tokens `prompt` shares with `tokens`: all but the prompt's last at most,
    whose logits prefill must compute."""
    n = min(len(prompt) - 1, len(tokens))
    differ = np.flatnonzero(np.asarray(prompt[:n], np.int32) != np.asarray(tokens[:n], np.int32))
    return int(differ[0]) if len(differ) else max(n, 0)


def reusable(prompt: list[int], held: np.ndarray, whole: bool = False) -> int:
    """How many leading prompt tokens a row whose cache holds the K/V of the tokens `held` (from
    position 0) can take instead of prefilling them: their common prefix, or 0 if that is under
    MIN_REUSE. `whole`: the row's memory is only known after all of `held` (a recurrent layer's
    state, which cannot be cut back to an earlier position): all of it, or nothing."""
    common = common_prefix(prompt, held)
    if whole and common < len(held):
        return 0
    return common if common >= MIN_REUSE else 0


def check_text_fits(text: str, tokenizer, max_context: int) -> None:
    """Before tokenizing: a text longer than any `max_context` tokens of this tokenizer can spell
    (each covers at most its longest piece's characters) cannot fit, and is refused without being
    tokenized (a 50 MB batch line took 2.6 GB to tokenize before the context check refused it)."""
    bound = max_context * tokenizer.max_piece_chars
    if len(text) > bound:
        raise JaxinferError(
            f"the prompt is {len(text):,} characters: more than {max_context} tokens (the context) can hold "
            f"with this tokenizer (at most {bound:,}); shorten the prompt or raise max_context",
            "max_context",
        )


def check_fits(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Refuse a sequence the cache cannot hold: every caller's one check, before it admits a row."""
    if prompt_tokens < 1:
        raise JaxinferError("the prompt is empty: give some text to continue")
    if max_tokens < 1:
        raise JaxinferError("max_tokens must be at least 1", "max_tokens")
    if prompt_tokens + max_tokens > max_context:
        raise JaxinferError(
            f"the prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context of {max_context}; "
            "shorten the prompt, lower max_tokens or raise max_context",
            "max_tokens",
            "max_context",
        )
