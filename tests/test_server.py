"""`jaxinfer serve`: the real server on a free loopback port, driven by the official `openai` client
(sync and async, streaming and not) and by raw HTTP (bad bodies, auth, disconnects, the queue bound,
SIGTERM's drain). Greedy answers are compared with `jaxinfer run` on the same prompt."""

import asyncio
import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from cli_helpers import jaxinfer

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
PROMPT = "def fibonacci(n):"
LONG = {"max_tokens": 400, "ignore_eos": True}  # our extension: a row that runs until it is cancelled or done
WAIT_S = 240  # a bound on waiting for an event, never a pause
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


class Served:
    """A `jaxinfer serve` process on a free port (read from the line that says where it listens),
    its stderr kept."""

    def __init__(self, *flags):
        self.process = subprocess.Popen(["jaxinfer", "serve", "--port", "0", *flags], stderr=subprocess.PIPE, text=True)
        self.stderr, found = [], None
        for line in self.process.stderr:  # until it says where it listens (EOF: it failed to start)
            self.stderr.append(line)
            if found := re.search(r"serving .* on http://([\d.]+):(\d+)/v1", line):
                break
        assert found, "".join(self.stderr)
        self.url = f"http://{found[1]}:{found[2]}"
        self._reader = threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True)
        self._reader.start()

    def stop(self, sig=signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(WAIT_S)
        self._reader.join(WAIT_S)
        return code


@pytest.fixture(scope="module")
def server():
    served = Served("-b", "2", "--max-queue", "2", "--api-key", KEY, "-c", "512")
    yield served
    assert served.stop() == 128 + signal.SIGTERM, "".join(served.stderr)
    assert "Traceback" not in "".join(served.stderr)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=WAIT_S, max_retries=0)


def http(server, method, path, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=WAIT_S, **kwargs)


def busy(server) -> float:
    metrics = http(server, "GET", "/metrics").text
    return float(re.search(r"^jaxinfer_slots_busy (\S+)$", metrics, re.M)[1])


def bundled_id(token: str) -> int:
    """The bundled model's id of a token, by its text."""
    from jaxinfer.modeldir import bundled_model_dir
    from jaxinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer(bundled_model_dir())
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == token.encode())


def until(condition) -> None:
    """Wait for `condition()` (checked as events come), at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_greedy_completion_equals_run(server, client):
    said = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0)
    ran = jaxinfer("run", PROMPT, "-n", 24, "--temp", 0, "--json")
    assert ran.returncode == 0, ran.stderr
    assert said.choices[0].text == json.loads(ran.stdout)["text"]
    assert said.choices[0].finish_reason == "length"
    assert said.usage.completion_tokens == 24 and said.usage.prompt_tokens == json.loads(ran.stdout)["prompt_tokens"]
    streamed = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == said.choices[0].text
    echoed = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, echo=True, logprobs=1)
    assert echoed.choices[0].text == PROMPT + said.choices[0].text
    assert len(echoed.choices[0].logprobs.tokens) == said.usage.prompt_tokens + 24


def test_chat_streamed_equals_whole_sync_and_async(server, client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    async def both():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=WAIT_S, max_retries=0)
        said = await aclient.chat.completions.create(model="any", messages=messages, max_tokens=20, temperature=0)
        stream = await aclient.chat.completions.create(
            model="any", messages=messages, max_tokens=20, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return said.choices[0].message.content, text

    assert asyncio.run(both()) == (whole.choices[0].message.content,) * 2


def test_concurrent_streams_each_get_their_whole_answer(server, client):
    """Clients at once, more than the slots and the queue can hold together (2 + 2): each stream is
    its answer alone, whole, whatever it was batched with (the 429s retried, as clients do)."""
    prompts = [f"def {name}(x):" for name in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")]
    alone = {
        p: client.completions.create(model="any", prompt=p, max_tokens=20, temperature=0).choices[0].text
        for p in prompts
    }

    async def streams():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=WAIT_S, max_retries=20)

        async def one(prompt):
            stream = await aclient.completions.create(
                model="any", prompt=prompt, max_tokens=20, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*map(one, prompts))

    assert dict(zip(prompts, asyncio.run(streams()))) == alone


def test_choices_seeds_logprobs_and_schema(server, client):
    two = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2)
    again = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert two.usage.completion_tokens == 24
    said = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = said.choices[0].logprobs.content
    assert len(content) == said.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    greedy = client.completions.create(model="any", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    banned = client.completions.create(
        model="any",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        frequency_penalty=1.5,
        logprobs=0,
        logit_bias={str(bundled_id(first)): -100},
    )
    assert banned.choices[0].logprobs.tokens[0] != first
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    typed = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "A number."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(typed.choices[0].message.content)["n"], int)


def test_prefix_reuse_across_requests(server, client):
    prompt = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n"
    first = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    second = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_two_choices_take_one_prefill(server, client):
    """The second choice of a prompt waits a step for the first's prefill and copies its K/V
    (`Scheduler._admit`): the prompt's tokens but the last come from a cache, none prefilled twice."""

    def cached() -> float:
        metrics = http(server, "GET", "/metrics").text
        return float(re.search(r"^jaxinfer_cached_prompt_tokens_total (\S+)$", metrics, re.M)[1])

    prompt = "class Config:\n    def __init__(self, path, mode='r', encoding='utf-8'):\n        self.path = path\n"
    before = cached()
    answer = client.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0, n=2)
    assert answer.choices[0].text == answer.choices[1].text  # greedy: the same text twice
    assert cached() - before == answer.usage.prompt_tokens - 1


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": PROMPT, "temperature": "hot"}).encode(), 400, '"temperature" must be a number'),
        (json.dumps({"prompt": PROMPT, "max_tokens": 600}).encode(), 400, "exceeds the context of 512"),
        (json.dumps({"prompt": "x " * 5000}).encode(), 400, "context"),
        (json.dumps({"prompt": PROMPT, "bogus": 1}).encode(), 400, "unknown field 'bogus'"),
        (json.dumps({"prompt": PROMPT, "n": 0}).encode(), 400, '"n" must be'),
        (json.dumps({"prompt": PROMPT, "presence_penalty": 3}).encode(), 400, "presence_penalty must be from -2"),
        (json.dumps({"prompt": PROMPT, "logit_bias": {"x": 1}}).encode(), 400, "not a token id"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, 'takes "prompt"'),
        (json.dumps({"prompt": PROMPT, "tools": [WEATHER]}).encode(), 400, '"tools" go with "messages"'),
        (json.dumps({"prompt": PROMPT, "echo": True, "stream": True}).encode(), 400, '"echo" is not streamed'),
        (b'{"prompt": "' + b"x" * (17 << 20) + b'"}', 413, "over"),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, words):
    answer = http(server, "POST", "/v1/completions", content=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"] and error["type"]
    assert http(server, "GET", "/health").json() == {"status": "ok"}  # still serving


def test_tools_need_a_template_that_offers_them(server):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    answer = http(server, "POST", "/v1/chat/completions", json=body)
    assert answer.status_code == 400 and "offers no tools" in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "tools"


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The bundled model with Qwen 2.5's chat template, which offers tools (as <tool_call> blocks)."""
    from jaxinfer.modeldir import bundled_model_dir

    model = tmp_path_factory.mktemp("tool-model") / "with-tools"
    shutil.copytree(bundled_model_dir(), model)
    shutil.copy(Path(__file__).parent / "chat_templates" / "qwen2.5.jinja", model / "chat_template.jinja")
    served = Served("-m", model, "-b", "2", "-c", "512")
    yield served
    assert served.stop() == 128 + signal.SIGTERM


def test_tool_calls_come_back_parsed(tool_server):
    """The model is held to a call by a regular expression (it never learned to call tools), so the
    text is known; the server must hand it back as a call, streamed or not, and take the next turn."""
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    asked = dict(model="any", messages=messages, tools=[WEATHER], temperature=0, max_tokens=60)
    forced = {"guided_regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'}
    said = client.chat.completions.create(**asked, extra_body=forced)
    (call,) = said.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert said.choices[0].finish_reason == "tool_calls" and said.choices[0].message.content is None
    chunks = [c for c in client.chat.completions.create(**asked, extra_body=forced, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the call's text is not content
    (streamed,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    turn = messages + [said.choices[0].message.model_dump(exclude_none=True)]
    turn += [{"role": "tool", "tool_call_id": call.id, "content": "18 °C"}]
    after = client.chat.completions.create(model="any", messages=turn, tools=[WEATHER], temperature=0, max_tokens=8)
    assert after.choices[0].finish_reason in ("length", "stop", "tool_calls")
    plain = client.chat.completions.create(**asked | {"tool_choice": "none"}, extra_body=forced)
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content


def test_a_forced_call_is_a_call(tool_server):
    """tool_choice "required" or a named function: the reply is a call of it, arguments valid."""
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Köln"]}}, "required": ["city"]}
    city["additionalProperties"] = False  # without it extra keys are valid, and this model adds them
    tools = [WEATHER | {"function": {"name": "get_weather", "parameters": city}}]
    tools.append({"type": "function", "function": {"name": "get_time", "parameters": city}})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, names in [("required", {"get_weather", "get_time"}), (_named("get_time"), {"get_time"})]:
        said = client.chat.completions.create(
            model="any", messages=messages, tools=tools, tool_choice=choice, temperature=0, max_tokens=80
        )
        calls = said.choices[0].message.tool_calls
        assert said.choices[0].finish_reason == "tool_calls" and calls, said
        assert all(
            c.function.name in names and json.loads(c.function.arguments)["city"] in ("Paris", "Köln") for c in calls
        )
    both = http(
        tool_server,
        "POST",
        "/v1/chat/completions",
        key=None,
        json={
            "messages": messages,
            "tools": tools,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    )
    assert both.status_code == 400 and "cannot both hold" in both.json()["error"]["message"]


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_auth_and_unknown_paths(server):
    assert http(server, "GET", "/v1/models", key=None).status_code == 401
    assert http(server, "GET", "/v1/models", key="wrong").status_code == 401
    assert http(server, "POST", "/v1/completions", key=None, json={"prompt": PROMPT}).status_code == 401
    assert http(server, "GET", "/health", key=None).status_code == 200
    assert http(server, "GET", "/v1/models").json()["data"][0]["id"] == "stdlib-llama-11m"
    missing = http(server, "GET", "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_a_client_that_leaves_frees_its_slot(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "stream": True, **LONG},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=WAIT_S,
    ) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert busy(server) == 1
    until(lambda: busy(server) == 0)
    with httpx.Client(timeout=WAIT_S, headers={"Authorization": f"Bearer {KEY}"}) as c:  # not streamed
        thread = threading.Thread(target=lambda: _leave(c, server))
        thread.start()
        until(lambda: busy(server) == 1)
        c.close()
        thread.join(WAIT_S)
    until(lambda: busy(server) == 0)


def _leave(c: httpx.Client, server) -> None:
    try:
        c.post(server.url + "/v1/completions", json={"prompt": PROMPT, **LONG, "max_tokens": 500})
    except httpx.HTTPError:
        pass  # the client closed under it: the point


def queued(server) -> float:
    metrics = http(server, "GET", "/metrics").text
    return float(re.search(r"^jaxinfer_queue_length (\S+)$", metrics, re.M)[1])


def test_the_queue_bound_answers_429(server):
    """Two slots and a queue of two, all taken by long requests: the next is refused at once, and
    the server serves again once they are gone."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=WAIT_S, headers=headers, limits=httpx.Limits(max_connections=8)) as c:
        body = {"prompt": PROMPT, **LONG, "max_tokens": 500, "stream": True}
        streams = [c.stream("POST", server.url + "/v1/completions", json=body) for _ in range(4)]
        answers = [stream.__enter__() for stream in streams]
        until(lambda: busy(server) == 2 and queued(server) == 2)
        refused = http(server, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert refused.status_code == 429 and "waiting for a slot" in refused.json()["error"]["message"]
        for stream in streams:  # the clients leave: their rows and queue places are freed
            stream.__exit__(None, None, None)
        assert all(a.status_code == 200 for a in answers)
    until(lambda: busy(server) == 0 and queued(server) == 0)
    assert http(server, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_and_ctrl_c_stops(sig):
    """SIGTERM: the running request and the two waiting finish whole, then the process exits;
    Ctrl-C: the running one is answered at once with what it made, the waiting ones are refused
    at once (they waited for clients' timeouts before)."""
    served = Served("-b", "1", "-c", "512")
    got = [[], [], []]
    short = {"max_tokens": 6, "ignore_eos": True}

    def stream(k, extra):
        with httpx.stream(
            "POST",
            served.url + "/v1/completions",
            json={"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}, **extra},
            timeout=WAIT_S,
        ) as answer:
            got[k].extend(line for line in answer.iter_lines() if line)

    readers = [threading.Thread(target=stream, args=(k, LONG if k == 0 else short)) for k in range(3)]
    readers[0].start()
    until(lambda: any(line.startswith("data: {") for line in got[0]))
    for reader in readers[1:]:
        reader.start()
    until(
        lambda: (
            float(re.search(r"^jaxinfer_queue_length (\S+)$", httpx.get(served.url + "/metrics").text, re.M)[1]) == 2
        )
    )
    code = served.stop(sig)
    for reader in readers:
        reader.join(WAIT_S)
    assert code == 128 + sig
    assert "Traceback" not in "".join(served.stderr)
    assert got[0][-1] == "data: [DONE]"  # answered, whole or cut
    *chunks, usage = [json.loads(line[6:]) for line in got[0] if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    made = usage["usage"]["completion_tokens"]
    waited = [[json.loads(line[6:]) for line in lines if line.startswith("data: {")] for lines in got[1:]]
    if sig == signal.SIGTERM:
        assert "draining: 3 requests to finish" in "".join(served.stderr)
        assert made == LONG["max_tokens"]
        assert [w[-1]["usage"]["completion_tokens"] for w in waited] == [short["max_tokens"]] * 2
    else:
        assert "stopping: 3 requests to finish" in "".join(served.stderr)
        assert 0 < made < LONG["max_tokens"]
        for w in waited:
            assert "shutting down" in w[-1]["error"]["message"] and not any("choices" in c for c in w)
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/health")


def test_a_second_ctrl_c_exits_at_once_without_traces():
    served = Served("-b", "1", "-c", "512")
    got = []

    def stream():
        try:
            with httpx.stream(
                "POST", served.url + "/v1/completions", json={"prompt": PROMPT, "stream": True, **LONG}
            ) as a:
                got.extend(a.iter_lines())
        except httpx.HTTPError:
            pass  # cut: the server is gone
        got.append("ended")

    reader = threading.Thread(target=stream)
    reader.start()
    until(lambda: any(line.startswith("data: {") for line in got))
    served.process.send_signal(signal.SIGINT)
    assert served.stop(signal.SIGINT) == 130
    reader.join(WAIT_S)
    assert got[-1] == "ended" and "Traceback" not in "".join(served.stderr), "".join(served.stderr)


def test_a_port_in_use_is_one_line_before_the_model_loads(server):
    """It failed in uvicorn's words (exit 3) once the model had loaded; the bundled model has no
    chat template, and the server says what its chat endpoint renders instead."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            ["jaxinfer", "serve", "--port", str(port)], capture_output=True, text=True, timeout=WAIT_S
        )
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use (--port 0 takes any free one)"
    )
    assert "no chat template: using plain 'User:'/'Assistant:' turns" in "".join(server.stderr)
