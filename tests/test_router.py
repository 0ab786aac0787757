"""Several models behind one server (`serve -m A -m B`, `jaxinfer.router`): each request answered by
the model it names (or an alias of it names), as that model alone answers it (greedy); with memory
for one model at a time, requests alternating between two under load are all answered (each switch
waits for the other model's requests to end), with room for both both stay held; an unknown model
is a 404; /v1/models and /api/tags list both and the alias."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from test_server import WAIT_S, Served

from jaxinfer.api import Parser
from jaxinfer.loading import load_model
from jaxinfer.router import Router
from jaxinfer.scheduler import Scheduler

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France", "Def fibonacci(n):", "Emoji 🙂 and", "x"]


@pytest.fixture(scope="module")
def models(tiny):
    return {path.name: path for path in (tiny("llama"), tiny("qwen3"))}


def alone(path) -> dict[str, str]:
    """Each prompt's greedy text from the model alone."""
    model, records = load_model(path), []
    requests = [Parser(model, 256).parse(p, {"prompt": p, "temperature": 0, "max_tokens": 12}) for p in PROMPTS]
    Scheduler(model, 1, 256).run(requests, records.append)
    return {r["id"]: r["text"] for r in records}


def test_each_request_goes_to_the_model_it_names(models):
    expected = {(name, p): text for name, path in models.items() for p, text in alone(path).items()}
    (first, a), (second, b) = models.items()
    expected |= {("other", p): expected[(second, p)] for p in PROMPTS}
    # each tiny model's weights and cache pass 1K: one held at a time, though --models-max is 2
    served = Served("-m", a, "-m", b, "--models-memory", "1K", "-a", f"other={second}", "-b", "2", "-c", "256")
    try:
        listed = httpx.get(served.url + "/v1/models", timeout=WAIT_S).json()
        assert [(m["id"], m.get("parent")) for m in listed["data"]] == [
            (first, None),
            (second, None),
            ("other", second),
        ]
        tags = httpx.get(served.url + "/api/tags", timeout=WAIT_S).json()
        assert {m["name"] for m in tags["models"]} == {first, second, "other"}
        assert [m["name"] for m in httpx.get(served.url + "/api/ps", timeout=WAIT_S).json()["models"]] == [first]

        def ask(name_prompt):
            name, prompt = name_prompt
            body = {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 12}
            answer = httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT_S)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        asked = [(name, p) for p in PROMPTS for name in (first, "other")] * 2  # alternating: a switch every request
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, asked))
        assert answers == [expected[key] for key in asked]
        assert expected[(first, PROMPTS[0])] != expected[(second, PROMPTS[0])]  # the models differ: it can fail
        assert len(httpx.get(served.url + "/api/ps", timeout=WAIT_S).json()["models"]) == 1  # the memory's bound
        missing = httpx.post(served.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=WAIT_S)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "nope" in missing.json()["error"]["message"]
    finally:
        served.stop()
    assert "Traceback" not in "".join(served.stderr)


class _Gated:
    """A stand-in model server for the router: each request it answers waits for its gate."""

    def __init__(self, gates: dict, served: list):
        self.gates, self.served = gates, served
        self.parser = SimpleNamespace(model=SimpleNamespace(params={}))
        self.scheduler = SimpleNamespace(slots=SimpleNamespace(state={}))

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    async def asgi(self, scope, receive, send) -> None:
        tag = json.loads((await receive())["body"])["tag"]
        await self.gates[tag].wait()
        self.served.append(tag)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_model_asked_for_without_pause_does_not_keep_another_waiting():
    """Room for one model: while a request waits for the second model to be made, the first model
    takes no new requests (else one asked for without pause keeps the other waiting for ever): its
    running request ends, the second is made and answers, then the first's next request."""
    gates, served = {tag: asyncio.Event() for tag in ("a1", "b1", "a2")}, []
    servers = {"a": _Gated(gates, served), "b": _Gated(gates, served)}
    router = Router({name: (lambda s=s: s) for name, s in servers.items()}, models_max=1)

    async def ask(model: str, tag: str) -> None:
        body = json.dumps({"model": model, "tag": tag}).encode()
        received = iter([{"type": "http.request", "body": body, "more_body": False}])
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b""}

        async def send(message):
            pass

        await router(scope, lambda: asyncio.sleep(0, next(received)), send)

    async def scenario() -> None:
        a1 = asyncio.create_task(ask("a", "a1"))
        await asyncio.sleep(0.05)
        b1 = asyncio.create_task(ask("b", "b1"))  # waits for a1
        await asyncio.sleep(0.05)
        a2 = asyncio.create_task(ask("a", "a2"))  # the first model asked again meanwhile
        await asyncio.sleep(0.05)
        gates["b1"].set(), gates["a2"].set()
        gates["a1"].set()
        await asyncio.wait_for(asyncio.gather(a1, b1, a2), WAIT_S)

    asyncio.run(scenario())
    assert served == ["a1", "b1", "a2"]
    assert router.servers.keys() == {"a"}  # a2 made the first model again, after b1


def test_models_that_fit_the_memory_stay_held(models):
    a, b = models.values()
    served = Served("-m", a, "-m", b, "--models-memory", "1G", "-c", "256")
    try:
        for name in [*models, *models]:
            body = {"model": name, "prompt": "x", "max_tokens": 2}
            assert httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT_S).status_code == 200
        held = httpx.get(served.url + "/api/ps", timeout=WAIT_S).json()["models"]
        assert sorted(m["name"] for m in held) == sorted(models)
        # /metrics: both models' in one text, each family once, each sample named by its model
        text = httpx.get(served.url + "/metrics", timeout=WAIT_S).text
        assert text.count("# TYPE jaxinfer_requests_total counter") == 1
        for name in models:
            assert f'jaxinfer_requests_total{{endpoint="/v1/completions",model_name="{name}",status="200"}} 2.0' in text
        own = httpx.get(served.url + "/metrics", params={"model": a.name}, timeout=WAIT_S).text
        assert "model_name" not in own and 'jaxinfer_requests_total{endpoint="/v1/completions",status="200"} 2.0' in own
    finally:
        served.stop()


def test_an_idle_model_is_stopped_after_its_keep_alive(models):
    """--keep-alive (ollama's): a model idle that long is stopped, and made again when asked for; a
    request's keep_alive says it for its model (-1: for ever), and ollama's empty generate loads a
    model or, with keep_alive 0, stops it."""
    (first, a), (second, b) = models.items()
    served = Served("-m", a, "-m", b, "--keep-alive", "1s", "-c", "256")

    def held() -> list[str]:
        return sorted(m["name"] for m in httpx.get(served.url + "/api/ps", timeout=WAIT_S).json()["models"])

    def generate(body: dict) -> dict:
        answer = httpx.post(served.url + "/api/generate", json=body | {"stream": False}, timeout=WAIT_S)
        assert answer.status_code == 200, answer.text
        return answer.json()

    try:
        assert generate({"model": second, "prompt": "x", "options": {"num_predict": 2}})["done"]
        deadline = time.monotonic() + WAIT_S
        while second in held() and time.monotonic() < deadline:  # stopped a second after its answer
            time.sleep(0.1)
        assert held() == [first]  # the first was held from the start, and never asked for
        assert generate({"model": second, "keep_alive": -1})["done_reason"] == "load"
        assert generate({"model": first, "keep_alive": 0})["done_reason"] == "unload"
        assert held() == [second]
        assert generate({"model": first, "prompt": "x", "options": {"num_predict": 2}})["done"]  # made again
        bad = httpx.post(served.url + "/api/generate", json={"model": first, "keep_alive": "soon"}, timeout=WAIT_S)
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
    finally:
        served.stop()
    assert "Traceback" not in "".join(served.stderr)


def test_a_model_that_cannot_be_served_is_said_before_serving(models):
    from cli_helpers import assert_one_line_error, jaxinfer_here

    first = str(next(iter(models.values())))
    assert_one_line_error(jaxinfer_here("serve", "-m", first, "-m", "/nonexistent", "--port", "0"), "/nonexistent")
    assert_one_line_error(jaxinfer_here("serve", "-m", first, "-m", first, "--port", "0"), "under one name")
    assert_one_line_error(jaxinfer_here("serve", "-m", first, "-a", "x=nope", "--port", "0"), "--alias x=nope")
    assert_one_line_error(jaxinfer_here("serve", "-m", first, "--models-memory", "lots", "--port", "0"), "24G")
    assert_one_line_error(jaxinfer_here("serve", "-m", first, "--keep-alive", "soon", "--port", "0"), "--keep-alive")
