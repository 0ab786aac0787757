"""`jaxinfer bench`: both phases measured over a sweep of prompt lengths and batch sizes.

Each point builds its own fixed-shape state (a cache of prompt + new tokens positions, or
`max_context`) and drives it through `Slots`, as run and batch do. One untimed warm-up compiles every
program the point needs (compile time reported apart) and pays the first execution of each (it costs
extra on XLA CPU); then each repeat prefills random prompt tokens in every row (TTFT) and runs the
decode steps `STEPS_PER_CALL` to a dispatch, as run's loop does: a dispatch and the wait for its
result cost ~0.1 ms on the CPU, but on an H100 they took the 1B shape's measured step from 1.40 ms
(chunks of 64) to 3.34 ms (one step a call). ITL is each call's time over the tokens it made.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np

from jaxinfer.buckets import check_fits
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.forms import lay_out, layout_for_batch
from jaxinfer.roofline import (
    Cost,
    Storage,
    decode_step_cost,
    expert_share,
    phase_report,
    predicted_seconds,
    prefill_cost,
)
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling
from jaxinfer.sharding import mesh_of
from jaxinfer.slots import Admission, Decoding, Slots
from jaxinfer.timings import Speculated, percentile

STEPS_PER_CALL = 16


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_point(
    cfg: ModelConfig,
    params: dict,
    prompt_tokens: int,
    batch: int,
    new_tokens: int,
    repeat: int,
    ceilings,
    max_context: int | None = None,
    decoding: Decoding = Decoding(),
) -> dict:
    """One point of the sweep. The cache holds `max_context` positions (default: just the prompt and
    the new tokens); decode reads only the kv buckets the rows reach, whatever its size. Prompts
    longer than `decoding.prefill_chunk` are prefilled in chunks, as run does. Speculating, a step
    makes 1 to K+1 tokens per row: the point runs steps until every row has its tokens, and its
    ITL is a step's time over the tokens it made per row."""
    S = max_context or prompt_tokens + new_tokens
    check_fits(prompt_tokens, new_tokens, S)
    slots = Slots(cfg, params, batch, S, eos_ids=(), decoding=decoding)  # no EOS: every row runs all its steps
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_tokens)).tolist()
    speculate = decoding.speculating
    # each row its own seed
    admit = [
        Admission(r, prompts[r], new_tokens, seed=r, sampling=Sampling(), speculate=speculate) for r in range(batch)
    ]

    compiled = CompileReport()
    ttft, decode_s, itl = [], [], []
    experts, experts_passes = 0, 0  # a mixture's experts the decode passes read (`KVCache.experts_read`), their passes

    def counted() -> tuple:
        """(each row's decode passes, the experts read so far)."""
        return jax.device_get((slots.state.passes, slots.state.cache.experts_read))

    for r in range(repeat + 1):  # the first is the warm-up: it compiles every program the point needs
        start = time.perf_counter()
        slots.admit(admit, compiled)
        jax.block_until_ready(slots.state.length)
        first = time.perf_counter() - start
        steps, kv_read, buckets = [], [], set()  # each call's seconds; each pass's positions read; kv buckets
        made, (passes_before, read_before) = jax.device_get(slots.state.length), counted()
        while made.min() < prompt_tokens + new_tokens:
            start = time.perf_counter()
            ran = slots.step(STEPS_PER_CALL, compiled)
            length = jax.device_get(slots.state.length)
            steps.append(time.perf_counter() - start)
            # a call's passes read lengths from the rows' then to their now - 1
            read = slots.state.cache.positions_read(cfg, ran.kv_len, float(made.mean()), float(length.mean()) - 1)
            kv_read += [read] * ran.steps
            buckets.add(ran.kv_len)
            if r:
                itl.append(steps[-1] * batch / max(1, int((length - made).sum())))
            made = length
        passes_after, read_after = counted()
        passes = int((passes_after - passes_before).max())  # a call's loop may end before its steps: counted
        if read_before is not None:
            experts, experts_passes = experts + (int(read_after) - int(read_before)) % 2**32, experts_passes + passes
        if r:
            ttft.append(first)
            decode_s.append(sum(steps))

    storage = Storage.of_params(params)
    roofs = (ceilings.peak_flops, ceilings.peak_bandwidth)
    prefill_work = prefill_cost(cfg, storage, prompt_tokens, batch=batch)
    # cost is linear in the positions read; a mixture's experts as the passes counted them
    experts_a_pass = experts / experts_passes if experts_passes else None
    step = decode_step_cost(cfg, storage, round(statistics.fmean(kv_read)), batch, experts_a_pass)
    decode_work = Cost(step.flops * (new_tokens - 1), step.bytes * passes)  # weights read once per pass
    ttft_median, decode_median = statistics.median(ttft), statistics.median(decode_s)
    routed = {"experts_a_step": _experts_a_step(cfg, experts_a_pass, batch)} if experts_a_pass is not None else {}
    point = {
        "prompt_tokens": prompt_tokens,
        "batch": batch,
        "new_tokens": new_tokens,
        "max_context": S,
        "kv_buckets": sorted(buckets),
        "prefill_chunk": slots.prefill_chunk,
        "repeat": repeat,
        "compile_s": compiled.seconds,
        "ttft_s": _spread(ttft),
        "prefill_tok_s": batch * prompt_tokens / ttft_median,
        "decode_tok_s": _spread([batch * (new_tokens - 1) / s for s in decode_s]),
        "itl_ms": {"p50": 1000 * percentile(itl, 0.5), "p99": 1000 * percentile(itl, 0.99)},
        "prefill": phase_report(prefill_work, ttft_median, *roofs),
        "decode": phase_report(decode_work, decode_median, *roofs),
        "roofline_ttft_s": predicted_seconds(prefill_work, *roofs),
        "roofline_decode_tok_s": batch / predicted_seconds(step, *roofs),
    }
    return point | routed | ({"speculation": _speculated(slots)} if speculate else {})


def _experts_a_step(cfg: ModelConfig, read: float, batch: int) -> dict:
    """A decode step's distinct experts a mixture layer, as counted, beside even routing's estimate
    for `batch` rows, of how many."""
    even = cfg.num_experts * expert_share(cfg, batch)
    return {"counted": round(read / len(cfg.mixture_layers), 2), "even": round(even, 2), "of": cfg.num_experts}


def _speculated(slots: Slots) -> dict:
    """The last run's speculation over all rows."""
    slots.fetch()
    c = slots.counters
    return Speculated(
        int(c.drafted.sum()), int(c.accepted.sum()), int(c.passes.sum()), int(c.passes.sum() + c.accepted.sum())
    ).as_dict()


def sweep(
    cfg: ModelConfig,
    params: dict,
    prompts: list[int],
    batches: list[int],
    new_tokens: int,
    repeat: int,
    ceilings,
    progress: Callable[[int, int], None] | None = None,
    max_context: int | None = None,
    decoding: Decoding = Decoding(),
) -> list[dict]:
    points = [(p, b) for b in batches for p in prompts]
    mesh = mesh_of(params)
    sharded = mesh is not None
    # as loaded; each batch size decodes on its fastest layout, as run and batch do
    layouts = {layout_for_batch(1, sharded): params}
    rows = []
    for done, (p, b) in enumerate(points):
        if progress:
            progress(done, len(points))
        layout = layout_for_batch(b, sharded)
        if layout not in layouts:
            layouts[layout] = lay_out(params, "in_out")
        point = bench_point(
            cfg,
            layouts[layout],
            p,
            b,
            new_tokens,
            repeat,
            ceilings,
            max_context,
            decoding,
        )
        rows.append({**point, "layout": layout, "devices": mesh.size if sharded else 1})
    if progress:
        progress(len(points), len(points))
    return rows


def plot(rows: list[dict], path, title: str) -> None:
    """TTFT against prompt length, and decode tokens/s against batch size, each beside the roofline's
    prediction for the same points."""
    try:
        import matplotlib
    except ImportError:
        raise JaxinferError('plotting needs matplotlib: pip install "jaxinfer[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for b in sorted({r["batch"] for r in rows}):
        mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["prompt_tokens"])
        x = [r["prompt_tokens"] for r in mine]
        line = left.plot(x, [1000 * r["ttft_s"]["median"] for r in mine], "o-", label=f"batch {b}")[0]
        left.plot(
            x, [1000 * r["roofline_ttft_s"] for r in mine], "--", color=line.get_color(), label=f"batch {b}, roofline"
        )
    left.set(yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)", title="Prefill")
    for p in sorted({r["prompt_tokens"] for r in rows}):
        mine = sorted((r for r in rows if r["prompt_tokens"] == p), key=lambda r: r["batch"])
        x = [r["batch"] for r in mine]
        line = right.plot(x, [r["decode_tok_s"]["median"] for r in mine], "o-", label=f"prompt {p}")[0]
        right.plot(
            x, [r["roofline_decode_tok_s"] for r in mine], "--", color=line.get_color(), label=f"prompt {p}, roofline"
        )
    right.set(yscale="log", xlabel="batch size", ylabel="decode tokens/s (all rows)", title="Decode")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
