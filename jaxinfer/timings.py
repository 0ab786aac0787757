"""What a generation measured: its phases' times, its tokens, its compiles, its speculation.
The scheduler keeps one `Timings` per row as the row runs; `run --stats`, the records of batch and
serve, and the benchmarks read them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from jaxinfer.runtime import CompileReport


def percentile(values: list[float], q: float) -> float:
    """The value at rank ⌊q·n⌋ of the sorted values (the largest for q near 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Speculated:
    """What speculation did for a generation: draft tokens verified, of them kept, decode passes."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    decoded: int = 0  # tokens the passes made

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "tokens_per_step": round(self.decoded / self.passes, 4) if self.passes else 0.0,
        }


@dataclass
class Timings:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the KV cache from an earlier request: not prefilled
    generated_tokens: int = 0
    ttft_s: float = 0.0  # prefill dispatch → first token on the host, compile excluded
    decode_s: float = 0.0  # wall time of the decode loop after the first token, compile excluded
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    kv_read: float = 0.0  # cache positions the decode passes read, summed over passes (`KVCache.positions_read`)
    # a mixture's: the experts its decode passes after the first token read (`KVCache.experts_read`;
    # in a batch, with the prompt chunks riding in them), and how many passes those were
    experts_read: int = 0
    experts_passes: int = 0
    compile: CompileReport = field(default_factory=CompileReport)
    speculation: Speculated | None = None  # where the decode loop speculated

    @property
    def experts_a_pass(self) -> float | None:
        """The distinct experts a decode pass read over all its mixtures, as counted; None: not counted."""
        return self.experts_read / self.experts_passes if self.experts_passes else None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s else 0.0

    def itl_ms(self) -> dict[str, float]:
        if not self.itl_s:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
        ms = [1000 * s for s in self.itl_s]
        return {"mean": statistics.fmean(ms), "p50": percentile(ms, 0.5), "p90": percentile(ms, 0.9)}

    def as_dict(self) -> dict:
        spec = {"speculation": self.speculation.as_dict()} if self.speculation else {}
        return spec | {
            "prefilled_tokens": self.prefilled_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "itl_ms": {k: round(v, 4) for k, v in self.itl_ms().items()},
            "compile_s": round(self.compile.seconds, 4),
            "compile_cache": self.compile.cache,
        }
