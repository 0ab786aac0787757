"""`jaxinfer serve`'s Prometheus metrics (GET /metrics): requests by endpoint and status, tokens,
TTFT and inter-token latency as clients see them, slots, queue, programs compiled."""

from __future__ import annotations

from types import SimpleNamespace

# TTFT from a few ms (a cached prompt) to a minute in a deep queue; ITL on any CPU or GPU
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    """The counters and histograms a server updates, and gauges that read `server` when scraped."""

    def __init__(self, server):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("jaxinfer_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "jaxinfer_cached_prompt_tokens", "Prompt tokens taken from a slot's cache, not prefilled", registry=r
        )
        self.generated = Counter("jaxinfer_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "jaxinfer_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jaxinfer_inter_token_latency_seconds", "Between a choice's tokens", buckets=ITL_BUCKETS, registry=r
        )
        busy = Gauge("jaxinfer_slots_busy", "Slots running a request", registry=r)
        busy.set_function(lambda: server.scheduler.busy)
        Gauge("jaxinfer_slots", "Slots (sequences decoded together)", registry=r).set(server.scheduler.batch_size)
        waiting = Gauge("jaxinfer_queue_length", "Requests waiting for a slot", registry=r)
        waiting.set_function(lambda: server.waiting)
        handled = Gauge("jaxinfer_requests_in_flight", "HTTP requests between arrival and answer", registry=r)
        handled.set_function(lambda: len(server._pending))
        compiled = Gauge("jaxinfer_programs_compiled", "Programs XLA compiled (or read from its cache)", registry=r)
        compiled.set_function(lambda: server.scheduler.stats.compile.programs)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def merged(servers: dict) -> bytes:
    """The metrics of several models' servers (name → server) as one Prometheus text: each family
    once, each sample with a `model_name` label (vLLM's)."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric

    families: dict[str, Metric] = {}
    for name, server in servers.items():
        for family in server.metrics.registry.collect():
            into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "model_name": name}, sample.value, sample.timestamp)
    return generate_latest(SimpleNamespace(collect=lambda: list(families.values())))
