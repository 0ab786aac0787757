"""Batch: continuous batching on the device (results independent of batch-mates, size and slot), and
the real `jaxinfer batch` job (JSONL contracts, bad lines, resume after a real SIGKILL)."""

import dataclasses
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reference import alone

from jaxinfer.errors import JaxinferError
from jaxinfer.forms import lay_out
from jaxinfer.jobs import open_output
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

PROMPTS = [
    "The capital of France is",
    "Def fibonacci(n):",
    "東京は日本の",
    "Emoji 🙂 and",
    "The capital of Italy is Rome. The capital of France",
    "x",
    "ünïcödé text and more text",
]


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("llama"))


def requests(model, sampling=Sampling(), stop=()):
    return [
        Request(i, model.tokenizer.encode(p), sampling, max_tokens=4 + 9 * (i % 4), seed=100 + i, stop=stop)
        for i, p in enumerate(PROMPTS)
    ]


def run_batch(model, reqs, batch_size, continuous=True):
    out = []
    Scheduler(model, batch_size, 128).run(reqs, out.append, continuous)
    return out


def by_id(records):
    return {r["id"]: (r["text"], r["generated_tokens"], r["finish_reason"]) for r in records}


def test_greedy_results_equal_run_whatever_the_batch(model):
    reqs = requests(model)
    expected = {}
    for r in reqs:
        gen = alone(model, r)
        expected[r.id] = (gen.text, len(gen.token_ids), gen.finish_reason)
    # what `jaxinfer batch` loads for B > 1
    batched = dataclasses.replace(model, params=lay_out(model.params, "in_out"))
    for batch_size in (1, 3, 8):
        assert by_id(run_batch(model, reqs, batch_size)) == expected
        assert by_id(run_batch(batched, reqs, batch_size)) == expected
    assert by_id(run_batch(batched, reqs[::-1], 3)) == expected  # other batch-mates, other slots


def test_sampled_results_depend_only_on_the_request_seed(model):
    reqs = requests(model, Sampling(temperature=0.9, top_p=0.95))
    first = by_id(run_batch(model, reqs, 3))
    assert by_id(run_batch(model, reqs[::-1], 5)) == first
    assert first[0][0] == alone(model, reqs[0]).text
    reseeded = [Request(r.id, r.prompt_ids, r.sampling, r.max_tokens, r.seed + 1) for r in reqs]
    assert by_id(run_batch(model, reseeded, 3)) != first


def test_continuous_batching_fills_a_slot_as_soon_as_it_frees(model):
    model = dataclasses.replace(model, eos_ids=())  # lengths exactly as asked
    ids = model.tokenizer.encode("The capital of France is")
    long = Request("long", ids, Sampling(), max_tokens=60, seed=0)
    shorts = [Request(f"short{i}", ids, Sampling(), max_tokens=3, seed=0) for i in range(4)]
    continuous = [r["id"] for r in run_batch(model, [long, *shorts], 2)]
    static = [r["id"] for r in run_batch(model, [long, *shorts], 2, continuous=False)]
    assert continuous[-1] == "long"  # every short went through the second slot while it ran
    assert static.index("long") == 1  # static: the next group waited for the long one


@pytest.mark.parametrize("how", ["float", "int8 cache", "a draft model"])
def test_requests_sharing_a_prompt_take_one_prefill_between_them(model, how):
    """Two choices of each of two prompts that share a system prompt: each later one copies the K/V
    another row holds (arriving together, it waits a step for its mate's prefill), and every text
    is what the request makes alone. The copy carries an int8 cache's scales and a draft's cache."""
    decoding = Decoding()
    if how == "int8 cache":
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, kv_dtype="int8"))
    if how == "a draft model":  # itself as its own draft: every token is checked through the copied caches
        decoding = Decoding(16, Speculation(3, model=model.config), model.params)
    system = "You answer every question in one short sentence, and nothing else at all. Question: "
    reqs = [
        Request(
            f"{question} {k}",
            model.tokenizer.encode(system + question),
            Sampling(temperature=0.8, repeat_penalty=1.3) if k else Sampling(),  # the penalty reads the prompt
            max_tokens=10,
            seed=k,
            speculate=how == "a draft model",
        )
        for question in ("Why is the sky blue?", "Where is Paris?")
        for k in range(2)
    ]
    records = {}
    Scheduler(model, 3, 128, decoding).run(reqs, lambda r: records.__setitem__(r["id"], r))
    for r in reqs:
        assert records[r.id]["text"] == alone(model, r).text, r.id
    first, again, other = reqs[0], reqs[1], reqs[2]
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_ids, other.prompt_ids)) if a != b)
    assert common >= 16  # MIN_REUSE: worth a copy
    assert records[first.id]["cached_tokens"] == 0
    assert records[again.id]["cached_tokens"] == len(first.prompt_ids) - 1  # all but the token that makes logits
    assert records[other.id]["cached_tokens"] == common


def test_ignore_eos_is_per_request_and_every_record_has_its_itl(model):
    ids = model.tokenizer.encode("The capital of France is")
    free = alone(dataclasses.replace(model, eos_ids=()), Request(0, ids, Sampling(), 12, 0))
    eos = free.token_ids[5]
    model = dataclasses.replace(model, eos_ids=(eos,))
    stops, runs_on = Request("eos", ids, Sampling(), 12, 0), Request("ignore", ids, Sampling(), 12, 0, ignore_eos=True)
    records = {r["id"]: r for r in run_batch(model, [stops, runs_on], 2)}
    assert (records["eos"]["finish_reason"], records["eos"]["generated_tokens"]) == (
        "eos",
        free.token_ids.index(eos) + 1,
    )
    assert (records["ignore"]["finish_reason"], records["ignore"]["generated_tokens"]) == ("length", 12)
    assert records["ignore"]["text"] == free.text
    for record in records.values():
        itl = record["timings"]["itl_ms"]
        assert 0 < itl["p50"] <= itl["p99"] <= itl["max"]


def test_stop_strings_in_a_batch_match_run(model):
    reqs = requests(model, stop=("a",))
    records = by_id(run_batch(model, reqs, 4))
    for r in reqs:
        gen = alone(model, r)
        assert records[r.id] == (gen.text, len(gen.token_ids), gen.finish_reason)
        assert "a" not in records[r.id][0]


# --- the real command ---------------------------------------------------------------------------


def jaxinfer_batch(*args, stdin=None, check=None):
    proc = subprocess.run(
        ["jaxinfer", "batch", *map(str, args)], input=stdin, capture_output=True, text=True, timeout=300
    )
    if check is not None:
        assert proc.returncode == check, proc.stderr
    return proc


def write_jsonl(path: Path, items) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def test_jsonl_through_stdin_and_stdout_with_bad_lines(tiny, tmp_path):
    path = tiny("llama")
    lines = [
        {"id": "a", "prompt": "The capital of France is", "max_tokens": 6},
        {"custom_id": 7, "prompt": "Def fibonacci(n):", "temperature": 0.8, "seed": 1, "max_tokens": 5},
        "{broken json",
        {"id": "no prompt"},
        {"id": "long", "prompt": "x", "max_tokens": 10_000},
        {"id": "bad temp", "prompt": "x", "temperature": "hot"},
    ]
    proc = jaxinfer_batch(
        "-",
        "-m",
        path,
        "-b",
        "2",
        stdin="".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
    )
    assert proc.returncode == 4, proc.stderr  # four bad lines
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    results = {r["id"]: r for r in records if "error" in r} | {r["id"]: r for r in records if "text" in r}
    assert results["a"]["generated_tokens"] <= 6 and results[7]["seed"] == 1 and "text" in results[7]
    errors = [r for r in records if "error" in r]
    assert [e["line"] for e in errors] == [3, 4, 5, 6]
    assert "exceeds the context" in errors[2]["error"]
    assert "Traceback" not in proc.stderr


def test_an_openai_job_is_all_in_openai_shape_and_a_repeated_id_refused_before_it_starts(tiny, tmp_path):
    """Lines that are not JSON or have no custom_id come back in OpenAI's error shape too, with the
    line; a file saved by a Windows editor (byte-order mark, CRLF) runs from its first line."""

    def line(custom_id, prompt):
        return json.dumps(
            {"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 3}}
        )

    lines = [line("a", "The capital of"), "{broken", json.dumps({"url": "/v1/completions", "body": {}}), line("b", "x")]
    (tmp_path / "in.jsonl").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    out = tmp_path / "out.jsonl"
    proc = jaxinfer_batch(tmp_path / "in.jsonl", "-m", tiny("llama"), "-o", out, check=2)
    records = [json.loads(r) for r in out.read_text().splitlines()]
    assert all(set(r) == {"id", "custom_id", "response", "error"} for r in records), records
    assert sorted(r["custom_id"] for r in records if r["response"]) == ["a", "b"], proc.stderr
    assert sorted(r["error"]["line"] for r in records if r["error"]) == [2, 3]
    jaxinfer_batch(tmp_path / "in.jsonl", "-m", tiny("llama"), "-o", out, "--resume", check=0)
    assert len(out.read_text().splitlines()) == 4  # the id-less errors not written again

    (tmp_path / "dup.jsonl").write_text("\n".join([line("a", "x"), line("b", "y"), line("a", "z")]) + "\n")
    proc = jaxinfer_batch(tmp_path / "dup.jsonl", "-m", tiny("llama"), "-o", tmp_path / "dup.out", check=1)
    assert (
        proc.stderr.strip().splitlines()[-1] == "error: lines 1 and 3 have the same id 'a': each request needs its own"
    )
    assert (tmp_path / "dup.out").read_text() == ""


def test_lines_split_at_newlines_only(tiny, tmp_path):
    """JSON leaves U+2028, U+2029, U+0085 and other separators raw inside strings (as
    json.dumps(ensure_ascii=False) and JSON.stringify write them): each request stays one line, and
    a CRLF file's lines are its lines. A bad line's number is the one an editor shows."""
    separators = "\u2028\u2029\u0085"  # control characters (\x1c, \x0b, ...) JSON escapes
    lines = [
        json.dumps({"id": i, "prompt": f"a{c}b{c}", "max_tokens": 2}, ensure_ascii=False)
        for i, c in enumerate(separators)
    ]
    lines.insert(2, "{broken")
    text = "\r\n".join(lines) + "\r\n"
    (tmp_path / "in.jsonl").write_bytes(text.encode())
    proc = jaxinfer_batch(tmp_path / "in.jsonl", "-m", tiny("llama"), "-o", tmp_path / "out.jsonl", check=1)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().split("\n") if line]
    assert sorted(r["id"] for r in records if "text" in r) == list(range(len(separators)))
    assert [r["line"] for r in records if "error" in r] == [3], proc.stderr


def test_sigterm_ends_a_batch_as_ctrl_c_does(tiny, tmp_path):
    """kill, systemd and `timeout` send SIGTERM: the job stops at the next step, every record written
    is whole, and the summary line is Ctrl-C's; the exit code says SIGTERM."""
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"id": i, "prompt": "The capital of", "max_tokens": 48} for i in range(40)]
    )
    out = tmp_path / "out.jsonl"
    job = subprocess.Popen(
        ["jaxinfer", "batch", str(inp), "-m", str(tiny("llama")), "-o", str(out), "-b", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_text().count("\n") >= 1):  # the first record is out
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=240)
    assert job.returncode == 128 + signal.SIGTERM, err
    assert "batch: " in err and " of 40 done" in err and "Traceback" not in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(records) < 40 and all("text" in r for r in records)


def test_the_default_budget_shrinks_to_the_room_a_prompt_leaves_and_a_given_one_is_refused(tiny, tmp_path):
    """As run: the default (generation_config.json's, else 256) shrinks to fit; a max_tokens the
    request or the job gives that the context cannot hold is an error record, never clipped."""
    long = "The capital of France is Paris. " * 6
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "default", "prompt": long}, {"id": "given", "prompt": long, "max_tokens": 60}]
    )
    out = tmp_path / "out.jsonl"
    jaxinfer_batch(inp, "-o", out, "-m", tiny("llama"), "-c", "64", check=1)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    fit = records["default"]
    assert fit["prompt_tokens"] + fit["generated_tokens"] <= 64 and fit["generated_tokens"] >= 1
    assert "exceeds the context" in records["given"]["error"]
    jaxinfer_batch(inp, "-o", tmp_path / "again.jsonl", "-m", tiny("llama"), "-c", "64", "-n", "60", check=2)


def test_a_50_mb_line_is_refused_before_it_is_tokenized(tiny, tmp_path):
    """A prompt longer than the context's tokens can spell is refused by its length, untokenized:
    the job's peak memory stays far below the 2.6 GB tokenizing it took; the next line still runs."""
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "huge", "prompt": "word " * 10_000_000}, {"id": "small", "prompt": "Hi", "max_tokens": 2}],
    )
    out = tmp_path / "out.jsonl"
    measure = (
        "import resource, subprocess, sys; "
        "code = subprocess.run(sys.argv[1:]).returncode; "
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    args = ["jaxinfer", "batch", str(inp), "-m", str(tiny("llama")), "-o", str(out)]
    code, peak_kib = map(
        int,
        subprocess.run(
            [sys.executable, "-c", measure, *args], capture_output=True, text=True, timeout=300
        ).stdout.split(),
    )
    assert code == 1 and peak_kib < 1_500_000  # KiB
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "50,000,000 characters" in records["huge"]["error"] and records["small"]["generated_tokens"] == 2


def test_a_disk_that_fills_mid_job_is_one_line_and_keeps_what_was_written(tiny, tmp_path):
    """-o on a 16 KiB tmpfs: the records that fit are there, whole but for a last one cut short
    (which --resume drops); the job says what happened in one line."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        inp = write_jsonl(
            tmp_path / "in.jsonl", [{"id": i, "prompt": "The capital of", "max_tokens": 8} for i in range(80)]
        )
        proc = jaxinfer_batch(inp, "-m", tiny("llama"), "-o", disk / "out.jsonl")
        lines = [line.strip() for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and lines == ["error: cannot go on: No space left on device"], proc.stderr
        assert "Traceback" not in proc.stderr
        written = (disk / "out.jsonl").read_text().split("\n")
        records = [json.loads(line) for line in written[:-1]]  # the last, cut short or empty
        assert len(records) >= 5 and all("text" in r for r in records)
    finally:
        subprocess.run(["umount", str(disk)])


def test_an_existing_output_is_never_overwritten(tiny, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hello"}])
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    proc = jaxinfer_batch(inp, "-o", out, "-m", tiny("llama"))
    assert proc.returncode == 1 and "--resume" in proc.stderr and out.read_text() == "precious\n"


def test_resume_keeps_whole_records_drops_only_a_cut_one_and_refuses_other_files(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = json.dumps({"id": 1, "text": "a"})
    out.write_text(whole)  # complete, only its newline missing
    earlier = open_output(out, resume=True)
    assert earlier.done == {"1"} and not earlier.dropped
    earlier.file.write(json.dumps({"id": 2}) + "\n")
    earlier.file.close()
    assert out.read_text().splitlines() == [whole, '{"id": 2}']

    out.write_text(f"{whole}\n{whole[:9]}")  # cut short by a kill
    earlier = open_output(out, resume=True)
    earlier.file.close()
    assert earlier.done == {"1"} and earlier.dropped == whole[:9] and out.read_text() == whole + "\n"

    for text in ("precious", "precious\nnotes", '{"no": "id"}\n', f"{whole}\n[1, 2]"):
        out.write_text(text)
        with pytest.raises(JaxinferError, match="not a jaxinfer batch record"):
            open_output(out, resume=True)
        assert out.read_text() == text  # refused untouched


def test_resume_records_each_bad_line_once_any_seed_runs_and_a_locked_output_is_refused(tiny, tmp_path):
    path = tiny("llama")
    sampled = {"prompt": "The capital of France is", "temperature": 0.9, "max_tokens": 8}
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "zero", "seed": 0, **sampled},
            {"id": "huge", "seed": 2**40, **sampled},  # 2**40 mod 2**32 = 0: the same draws
            {"id": "minus one", "seed": -1, "top_k": 10**12, **sampled},
            {"id": "max", "seed": 2**32 - 1, **sampled},
            "{broken",
            '{"id": "nan", "prompt": "x", "max_tokens": 4, "temperature": NaN}',
            {"id": "half k", "prompt": "x", "max_tokens": 4, "top_k": 2.5},
        ],
    )
    out = tmp_path / "out.jsonl"
    jaxinfer_batch(inp, "-o", out, "-m", path, "-b", "2", check=3)
    first = out.read_text()
    records = {r["id"]: r for r in map(json.loads, first.splitlines())}
    assert records["zero"]["text"] == records["huge"]["text"] and records["minus one"]["text"] == records["max"]["text"]
    assert records["huge"]["seed"] == 2**40 and records["zero"]["text"] != records["max"]["text"]
    assert "temperature" in records["nan"]["error"] and "top_k" in records["half k"]["error"]
    assert records[None]["line"] == 5
    jaxinfer_batch(inp, "-o", out, "-m", path, "-b", "2", "--resume", check=0)
    assert out.read_text() == first  # nothing run twice, the id-less error not appended again

    held = open_output(out, resume=False)  # as a running job holds it
    proc = jaxinfer_batch(inp, "-o", out, "-m", path, "--resume")
    held.file.close()
    assert proc.returncode == 1 and proc.stderr.strip().endswith("wait for it, or choose another output"), proc.stderr
    assert out.read_text() == first


def test_openai_batch_lines_in_and_out_beside_our_own_shape(tiny, tmp_path):
    chat, completion = "/v1/chat/completions", "/v1/completions"
    prompt = "The capital of France is"

    def line(custom_id, url, **body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            line(  # the API's defaults, which change nothing, are accepted
                "chat",
                chat,
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=5,
                temperature=0,
                n=1,
                stream=False,
                logprobs=False,
                top_logprobs=0,
                response_format={"type": "text"},
                tool_choice="auto",
                metadata={"job": "x"},
            ),
            line(
                "completion",
                completion,
                prompt=prompt,
                max_completion_tokens=6,
                temperature=0,
                repetition_penalty=1.0,
                top_k=0,
            ),
            {"id": "own", "prompt": prompt, "max_tokens": 6, "temperature": 0},
            line("embeddings", "/v1/embeddings", input="x"),
            line("unknown", completion, prompt="x", best_of=3),
            line("two", completion, prompt="x", n=2),
            line("wrong key", chat, prompt="x"),
            line("xml mode", chat, messages=[{"role": "user", "content": "x"}], response_format={"type": "xml"}),
            line(7, completion, prompt="x"),  # OpenAI's custom_id is a string
            {"id": "own unknown", "prompt": "x", "extra": 1},
        ],
    )
    out = tmp_path / "out.jsonl"
    jaxinfer_batch(inp, "-o", out, "-m", tiny("llama"), "-b", "2", check=7)
    records = {r.get("custom_id", r["id"]): r for r in map(json.loads, out.read_text().splitlines())}
    body = records["chat"]["response"]["body"]
    assert records["chat"]["response"]["status_code"] == 200 and records["chat"]["error"] is None
    assert records["chat"]["response"]["request_id"].startswith("req_")
    assert (
        body["object"] == "chat.completion"
        and body["model"] == tiny("llama").name  # the model that ran, not the one the line asked for
        and body["choices"][0]["message"]["role"] == "assistant"
    )
    assert (
        body["usage"]["completion_tokens"] <= 5
        and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    text = records["completion"]["response"]["body"]["choices"][0]
    # the same request, either shape
    assert text["text"] == records["own"]["text"] and text["finish_reason"] in (
        "stop",
        "length",
    )
    errors = {
        key: records[key]["error"]["message"] for key in ("embeddings", "unknown", "two", "wrong key", "xml mode")
    }
    assert (
        "/v1/completions" in errors["embeddings"]
        and "'best_of'" in errors["unknown"]
        and '"n"' in errors["two"]
        and '"messages"' in errors["wrong key"]
        and '"response_format"' in errors["xml mode"]
    )
    assert '"custom_id" must be a string' in records[7]["error"]["message"]
    assert all(records[key]["response"] is None and records[key]["id"].startswith("batch_req_") for key in errors)
    assert "'extra'" in records["own unknown"]["error"]
    first = out.read_text()
    jaxinfer_batch(inp, "-o", out, "-m", tiny("llama"), "--resume", check=0)
    assert out.read_text() == first  # OpenAI records are recognised as done by their custom_id


def test_a_job_killed_at_a_random_moment_resumes_to_the_same_results(tiny, tmp_path):
    N = 32
    slow = tiny("llama", hidden_size=256, num_hidden_layers=4, max_position_embeddings=1024)
    items = [{"id": i, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 150 + 8 * i} for i in range(N)]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    reference = tmp_path / "reference.jsonl"
    start = time.perf_counter()
    jaxinfer_batch(inp, "-o", reference, "-m", slow, "-b", "4", "-c", "512", check=0)
    print(f"uninterrupted job: {time.perf_counter() - start:.1f} s")

    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        ["jaxinfer", "batch", inp, "-o", killed, "-m", slow, "-b", "4", "-c", "512"], stderr=subprocess.DEVNULL
    )
    while not killed.exists() or killed.stat().st_size == 0:  # some results are out
        time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
    time.sleep(random.uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(killed.read_text().splitlines())
    jaxinfer_batch(inp, "-o", killed, "-m", slow, "-b", "4", "-c", "512", "--resume", check=0)

    def results(path):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return [r["id"] for r in records], {r["id"]: r["text"] for r in records}

    ids, texts = results(killed)
    assert sorted(ids) == list(range(N))  # every id exactly once
    assert texts == results(reference)[1]
    assert done_before < N  # it was killed mid-job
