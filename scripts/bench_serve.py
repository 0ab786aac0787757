"""`jaxinfer serve` under load on loopback: C concurrent streaming clients against `jaxinfer batch`'s
scheduler on the same requests, and a leak check over many requests with some clients leaving.

    python scripts/bench_serve.py                      # 64 clients, 64 requests, 128 tokens each
    python scripts/bench_serve.py --requests 256               # sustained load: 4 requests a client
    python scripts/bench_serve.py --clients 16 --requests 64 --tokens 64
    python scripts/bench_serve.py --leak 2000          # 10% of clients leave mid-stream; RSS and slots
    python scripts/bench_serve.py --protocols chat,messages,ollama   # each protocol's tok/s over chat's
    python scripts/bench_serve.py --protocols chat,messages,ollama --models 2 --models-max 1  # switches

The requests: seeded slices of this repository's Python source as prompts (16–64 tokens), greedy, EOS
off so every request makes `--tokens`. The server runs as `jaxinfer serve -b CLIENTS` (a process of its
own, as users run it); batch is `Scheduler(model, CLIENTS, ...)`, what `jaxinfer batch -b CLIENTS`
runs, in this process, its compile time taken out. Both are warmed up (batch twice; the server until
a round compiles no program, at least twice, at most 8 times: its admission groups vary with the
clients' arrival order), then `--rounds` timed rounds of each alternate, batch then serve (this
machine's speed drifts by ±20% between minutes: figures of two sittings do not compare); the
median of the rounds' ratios is reported, and the programs the server compiled in its timed rounds.
The clients are bare asyncio connections (`--client raw`: the request written by hand, the SSE
lines read as they come, only the usage chunk parsed), each checked to get its whole answer; they
share the server's cores, and httpx's (`--client httpx`) took 9% of a 2-core machine's CPU.
Reported: aggregate generated tokens/s of each and their ratio; the clients' time to first
token (from sending), inter-token latency (each request's time from its first text to its last over
its tokens after the first) and the gaps between streamed chunks (a chunk carries what a dispatch
made, ~50 ms of steps), p50 and p99. Run from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def prompts(count: int, seed: int = 0) -> list[str]:
    source = "\n".join(p.read_text() for p in sorted((ROOT / "jaxinfer").glob("*.py")))
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(len(source) - 400)
        out.append(source[start : start + rng.randrange(60, 240)])
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Server:
    def __init__(self, flags: list[str]):
        self.process = subprocess.Popen(["jaxinfer", "serve", "--port", "0", *flags], stderr=subprocess.PIPE, text=True)
        said, found = [], None
        for line in self.process.stderr:  # notices first (a model without a chat template), then where it listens
            said.append(line)
            if found := re.search(r"serving .* on http://([\d.]+):(\d+)/v1", line):
                break
        if not found:
            sys.exit("".join(said))
        self.url = f"http://{found[1]}:{found[2]}"
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


class _Watch:
    """One request's times as its chunks come: its first text (TTFT from sending), the gaps between
    texts, and its ITL (first text to last over the tokens after the first) once its usage says how many."""

    def __init__(self, seen: dict):
        self.seen, self.sent, self.first, self.last = seen, time.perf_counter(), None, None

    def text(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.seen["ttft"].append(now - self.sent)
            self.first = now
        else:
            self.seen["gaps"].append(now - self.last)
        self.last = now

    def usage(self, made: int) -> int:
        if made > 1 and self.last is not None and self.last > self.first:
            self.seen["itl"].append((self.last - self.first) / (made - 1))
        return made


def _body(prompt: str, tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    return body | {"stream_options": {"include_usage": True}}


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, leave: bool, seen: dict) -> int:
    """Stream one completion; returns the tokens it got (from the usage chunk)."""
    watch, made = _Watch(seen), 0
    async with client.stream("POST", url + "/v1/completions", json=_body(prompt, tokens)) as answer:
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                made = watch.usage(chunk["usage"]["completion_tokens"])
            elif chunk["choices"][0]["text"]:
                watch.text()
                if leave:
                    return 0
    return made


async def _posted(url: str, path: str, body: dict):
    """A bare asyncio connection with `body` POSTed to `path` (Connection: close): (reader, writer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n"
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.encode() + data)
    return reader, writer


async def one_raw(url: str, prompt: str, tokens: int, leave: bool, seen: dict) -> int:
    """`one` over a bare asyncio connection: the request written by hand, the answer read line by line,
    only the usage chunk parsed. The load generator shares the server's cores: httpx's parsing and a
    json.loads per event took 0.96 s of CPU in 5.55 s of four rounds of 64 × 128 (9% of 2 cores)."""
    watch, made = _Watch(seen), 0
    reader, writer = await _posted(url, "/v1/completions", _body(prompt, tokens))
    try:
        async for line in reader:  # headers, chunk sizes and blank lines pass by
            if not line.startswith(b"data: {"):
                continue
            if line.startswith(b'data: {"usage"') or b'"usage": {' in line:
                made = watch.usage(json.loads(line[6:])["usage"]["completion_tokens"])
            elif b'"text": ""' not in line:
                watch.text()
                if leave:
                    return 0
    finally:
        writer.close()
    return made


# --protocols: the same chat request in each protocol's shape; (path, body, a text event's mark, how
# the last event says the tokens made)
PROTOCOLS = {
    "chat": (
        "/v1/chat/completions",
        lambda m, n: {"messages": m, "max_tokens": n, "stream_options": {"include_usage": True}},
        b'"content": "',
        lambda e: (e.get("usage") or {}).get("completion_tokens"),
    ),
    "messages": (
        "/v1/messages",
        lambda m, n: {"model": "any", "messages": m, "max_tokens": n},
        b'"text_delta"',
        lambda e: e["usage"]["output_tokens"] if e.get("type") == "message_delta" else None,
    ),
    "ollama": (
        "/api/chat",
        lambda m, n: {"model": "any", "messages": m, "options": {"num_predict": n}},
        b'"done": false',
        lambda e: e.get("eval_count") if e.get("done") else None,
    ),
}


async def one_protocol(url: str, protocol: str, prompt: str, tokens: int, seen: dict, model: str = "any") -> int:
    """`one_raw` in `protocol`'s shape (greedy, streamed) to `model`: the tokens its last event says
    were made (0: none came)."""
    path, shape, mark, count = PROTOCOLS[protocol]
    body = shape([{"role": "user", "content": prompt}], tokens) | {"temperature": 0, "stream": True, "model": model}
    if protocol == "ollama":
        body["options"]["temperature"] = body.pop("temperature")
    watch, made = _Watch(seen), 0
    reader, writer = await _posted(url, path, body)
    try:
        async for line in reader:
            line = line.removeprefix(b"data: ").strip()
            if not line.startswith(b"{"):
                continue
            if mark in line and b'"content": ""' not in line:
                watch.text()
            elif (said := count(json.loads(line))) is not None:
                made = watch.usage(said)
    finally:
        writer.close()
    return made


async def load(
    url: str,
    texts: list[str],
    tokens: int,
    clients: int,
    leave_every: int = 0,
    raw: bool = False,
    protocol=None,
    mixed: list[tuple[str, str]] | None = None,
) -> tuple[int, float, dict]:
    """Every text sent by at most `clients` at once; `mixed`: each text's (protocol, model), and the
    tokens made by each request in `seen["made"]`."""
    seen = {"ttft": [], "gaps": [], "itl": []}
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def gated(i: int, text: str) -> int:
            leave = bool(leave_every) and i % leave_every == 0
            async with gate:
                if mixed:
                    made = await one_protocol(url, mixed[i][0], text, tokens, seen, mixed[i][1])
                    seen.setdefault("made", []).append(made)
                    return made
                if protocol:
                    return await one_protocol(url, protocol, text, tokens, seen)
                if raw:
                    return await one_raw(url, text, tokens, leave, seen)
                return await one(client, url, text, tokens, leave, seen)

        start = time.perf_counter()
        made = await asyncio.gather(*(gated(i, t) for i, t in enumerate(texts)))
    return sum(made), time.perf_counter() - start, seen


class Batch:
    """`jaxinfer batch`'s scheduler on the same requests, in this process: warmed up as the server is
    (twice), then `tok_s()` times one run, less its compile time."""

    def __init__(self, texts: list[str], tokens: int, clients: int, context: int):
        from jaxinfer.api import Parser
        from jaxinfer.forms import layout_for_batch
        from jaxinfer.loading import load_model
        from jaxinfer.scheduler import Scheduler

        model = load_model(layout=layout_for_batch(clients))
        parser = Parser(model, context)
        self.requests = [
            parser.parse(i, {"prompt": t, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
            for i, t in enumerate(texts)
        ]
        self.runner = Scheduler(model, clients, context)
        for _ in range(2):
            self.runner.run(self.requests, lambda r: None)

    def tok_s(self) -> float:
        stats = self.runner.stats
        done, compiled = stats.generated_tokens, stats.compile.seconds
        start = time.perf_counter()
        self.runner.run(self.requests, lambda r: None)
        seconds = time.perf_counter() - start - (stats.compile.seconds - compiled)
        return (stats.generated_tokens - done) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each, alternated")
    parser.add_argument(
        "--client", choices=("raw", "httpx"), default="raw", help="the clients: bare asyncio connections, or httpx"
    )
    parser.add_argument("--leak", type=int, default=0, metavar="N", help="N requests, every 10th client leaving")
    parser.add_argument(
        "--protocols",
        metavar="chat,messages,ollama",
        help="the same chat requests through each protocol (OpenAI's chat, Anthropic's messages, ollama's "
        "chat), alternated; each one's tok/s over the first's",
    )
    parser.add_argument(
        "--models",
        type=int,
        default=1,
        help="serve the bundled model under this many names (each a server of its own): the requests, spread "
        "over them and over --protocols, must all be answered",
    )
    parser.add_argument("--models-max", type=int, default=2, help="models held at once (serve's --models-max)")
    args = parser.parse_args()
    flags = ["-b", str(args.clients), "-c", str(args.context), "--max-queue", str(max(args.requests, args.leak))]
    if args.models > 1:
        return several_models(flags, args)
    server = Server(flags)
    try:
        if args.leak:
            texts = prompts(args.leak)
            rss, programs = [server.rss_mb()], [server.metric("jaxinfer_programs_compiled")]
            for part in range(0, args.leak, 500):
                part_texts = texts[part : part + 500]
                asyncio.run(load(server.url, part_texts, 32, args.clients, 10, args.client == "raw"))
                rss.append(server.rss_mb())
                programs.append(server.metric("jaxinfer_programs_compiled"))
            print(
                json.dumps(
                    {
                        "requests": args.leak,
                        "left_mid_stream": len(range(0, args.leak, 10)),
                        "rss_mb_per_500": [round(r, 1) for r in rss],
                        "programs_compiled_per_500": programs,
                        "in_flight_after": server.metric("jaxinfer_requests_in_flight"),
                        "slots_busy_after": server.metric("jaxinfer_slots_busy"),
                        "queue_after": server.metric("jaxinfer_queue_length"),
                    }
                )
            )
            return
        if args.protocols:
            return compare_protocols(server, args)
        texts = prompts(args.requests)
        batch = Batch(texts, args.tokens, args.clients, args.context)
        warm_up = 0  # the same set, until a round compiles nothing (from the second on, rows hold the prompts)
        while warm_up < 8:
            before = server.metric("jaxinfer_programs_compiled")
            asyncio.run(load(server.url, texts, args.tokens, args.clients, raw=args.client == "raw"))
            warm_up += 1
            if warm_up >= 2 and server.metric("jaxinfer_programs_compiled") == before:
                break
        before = server.metric("jaxinfer_programs_compiled")
        rounds = []  # (batch tok/s, serve tok/s), alternated: this machine drifts by ±20% between minutes
        seen = {"ttft": [], "gaps": [], "itl": []}
        for _ in range(args.rounds):
            batched = batch.tok_s()
            raw = args.client == "raw"
            made, seconds, round_seen = asyncio.run(load(server.url, texts, args.tokens, args.clients, raw=raw))
            assert made == len(texts) * args.tokens, made  # every client got its whole answer
            rounds.append((batched, made / seconds))
            for name, values in round_seen.items():
                seen[name] += values
        compiled = server.metric("jaxinfer_programs_compiled") - before
    finally:
        server.stop()
    ratios = [served / batched for batched, served in rounds]
    print(
        json.dumps(
            {
                "clients": args.clients,
                "client": args.client,
                "requests": args.requests,
                "tokens": args.tokens,
                "serve_tok_s": round(statistics.median(served for _, served in rounds), 1),
                "batch_tok_s": round(statistics.median(batched for batched, _ in rounds), 1),
                "serve_over_batch": round(statistics.median(ratios), 3),
                "rounds": [round(r, 3) for r in ratios],
                "warm_up_rounds": warm_up,
                "programs_compiled_in_timed_rounds": compiled,
                "ttft_ms": {q: round(1000 * percentile(seen["ttft"], p), 1) for q, p in (("p50", 0.5), ("p99", 0.99))},
                "itl_ms": {q: round(1000 * percentile(seen["itl"], p), 2) for q, p in (("p50", 0.5), ("p99", 0.99))},
                "chunk_gap_ms": {
                    q: round(1000 * percentile(seen["gaps"], p), 2) for q, p in (("p50", 0.5), ("p99", 0.99))
                },
            }
        )
    )


def several_models(flags: list[str], args) -> None:
    """The bundled model served under `--models` names (links to its directory) with `--models-max`
    held: the requests spread round-robin over the protocols and the models, twice (the first
    loads and compiles); every one must be answered."""
    import tempfile

    from jaxinfer.modeldir import bundled_model_dir

    names = (args.protocols or "chat").split(",")
    with tempfile.TemporaryDirectory() as tmp:
        links = [Path(tmp) / f"model-{i}" for i in range(args.models)]
        for link in links:
            link.symlink_to(bundled_model_dir(), target_is_directory=True)
        server = Server(
            [*flags, "--models-max", str(args.models_max), *(f for link in links for f in ("-m", str(link)))]
        )
        try:
            texts = prompts(args.requests)
            mixed = [(names[i % len(names)], links[(i // len(names)) % len(links)].name) for i in range(len(texts))]
            for _ in range(2):
                made, seconds, seen = asyncio.run(load(server.url, texts, args.tokens, args.clients, mixed=mixed))
        finally:
            server.stop()
    print(
        json.dumps(
            {
                "clients": args.clients,
                "requests": args.requests,
                "protocols": names,
                "models": args.models,
                "models_max": args.models_max,
                "answered": sum(m > 0 for m in seen["made"]),
                "tok_s": round(made / seconds, 1),
                "ttft_ms_p99": round(1000 * percentile(seen["ttft"], 0.99), 1),
            }
        )
    )


def compare_protocols(server: Server, args) -> None:
    """The same greedy chat requests (EOS on: each protocol renders the same prompt, so each makes the
    same tokens) through each protocol, warmed up twice each, then `--rounds` alternated rounds."""
    names, texts = args.protocols.split(","), prompts(args.requests)

    def tok_s(protocol: str) -> tuple[int, float]:
        made, seconds, _ = asyncio.run(load(server.url, texts, args.tokens, args.clients, protocol=protocol))
        return made, made / seconds

    for _ in range(2):
        for name in names:
            tok_s(name)
    rounds = {name: [] for name in names}
    for _ in range(args.rounds):
        made = {}
        for name in names:
            made[name], speed = tok_s(name)
            rounds[name].append(speed)
        assert len(set(made.values())) == 1, made  # the same tokens, whichever protocol asked
    first = names[0]
    ratios = {name: [b / a for a, b in zip(rounds[first], rounds[name])] for name in names[1:]}
    print(
        json.dumps(
            {
                "clients": args.clients,
                "requests": args.requests,
                "tokens": args.tokens,
                "tok_s": {name: round(statistics.median(v), 1) for name, v in rounds.items()},
                f"over_{first}": {name: round(statistics.median(v), 3) for name, v in ratios.items()},
                "rounds": {name: [round(r, 3) for r in v] for name, v in ratios.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
