"""Tensor parallelism (`--devices`): the same greedy tokens on 1 and 4 CPU devices (-q int8's on 2),
through run's engine and batch's runner, with the weights and the cache really split. The devices are XLA's CPU
devices, which must be asked for before JAX starts: the runs happen in a process of their own
(`tests/sharded.py`); two processes join one mesh through `jax.distributed`."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, jaxinfer
from sharded import BATCH, CHUNK, LONG

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

# the flags of the runs `sharded` made its results with (tests/sharded.py)
RUN = ("-c", "256", "-n", "60", "--temp", "0", "--ignore-eos", "--prefill-chunk", str(CHUNK))

# Between them: GQA whose kv heads divide 4, biases and tied embeddings (everything splits 4 ways;
# the sentencepiece tokenizer's 400 ids divide 4, so the head and the seen-token mask split too); and
# MQA (one kv head: the cache stays whole on each device) with Phi-3's fused q/k/v and gate/up rows.
MODELS = {
    "llama": dict(
        tokenizer="sp",
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "phi3": dict(num_key_value_heads=1),
}


@pytest.fixture(scope="module")
def sharded(tiny):
    paths = {arch: str(tiny(arch, **overrides)) for arch, overrides in MODELS.items()}
    proc = subprocess.run(
        [sys.executable, Path(__file__).with_name("sharded.py"), *paths.values()],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    return {arch: results[path] for arch, path in paths.items()}, paths


@pytest.mark.parametrize("arch", MODELS)
def test_devices_give_the_same_tokens(sharded, arch):
    by_devices = sharded[0][arch]
    one = by_devices["1"]
    assert len(one["run"]) == 60 and len(one["batch"]) == (len(BATCH) if arch == "llama" else 0)
    assert "4" in by_devices
    for devices in by_devices.keys() - {"1", "2"}:  # at 2 devices, -q int8 only
        assert by_devices[devices]["run"] == by_devices[devices]["again"] == one["run"], devices
        assert by_devices[devices]["batch"] == one["batch"], devices


def test_weights_and_cache_are_split(sharded):
    results = sharded[0]
    everything = results["llama"]["1"]["bytes"][0]
    for devices in (2, 4):  # all but the norms split
        held = results["llama"][str(devices)]["bytes"]
        assert len(held) == devices and max(held) < 1.05 * everything / devices, held
    # orbax restores into the same shards
    assert results["llama"]["4"]["converted"] and results["phi3"]["4"]["converted"]
    quantized = {n: results["llama"][n]["int8"] for n in ("1", "2")}
    assert quantized["2"]["run"] == quantized["1"]["run"]
    # Every matrix splits but down (80 inputs a device: not whole blocks of 32) and the embedding
    # (200 rows: not whole blocks of 16).
    assert max(quantized["2"]["bytes"]) < 0.75 * quantized["1"]["bytes"][0]
    assert all(max(q["bytes"]) == q["counted"] for q in quantized.values())  # info's rule is the loader's
    # The memory check counts each device's share of the cache, against the memory the CPU's devices
    # share: a split cache fits as long a context as on one device, a whole one (MQA) a quarter.
    assert results["llama"]["4"]["fits"] == pytest.approx(results["llama"]["1"]["fits"], rel=0.1)
    assert results["phi3"]["4"]["fits"] == pytest.approx(results["phi3"]["1"]["fits"] / 4, rel=0.1)
    assert results["llama"]["4"]["cache"] == "P(None, None, None, 'tensor')"
    assert results["phi3"]["4"]["cache"] == "P()"  # one kv head: whole on every device
    assert max(results["phi3"]["4"]["bytes"]) < 0.9 * results["phi3"]["1"]["bytes"][0]  # o and down still split


def test_constrained_rows_over_a_mesh(sharded):
    """The matchers' host call runs once a step over 4 devices as on one (not once per device, which
    would feed each matcher every token four times), and the rows make the same text."""
    one, four = (sharded[0]["llama"][n]["constrained"] for n in ("1", "4"))
    assert four == one and one["calls"] > 10
    assert one["texts"]["1"] in ("yes", "no")


def test_cli_devices(sharded):
    """The draft model goes onto the target's devices; info's figures are the arrays'. (That the flag
    reaches JAX before it starts, batch's layout choice included, the processes' test shows.)"""
    results, paths = sharded
    proc = jaxinfer(
        "run", "-m", paths["llama"], *RUN, "--draft-model", paths["llama"], "--devices", "4", "--json", LONG
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == results["llama"]["1"]["run"]
    assert_one_line_error(jaxinfer("run", "-m", paths["llama"], "--devices", "0", "x"), "--devices")
    # a constraint over 2 devices (the bundled model: its masks are what XLA split by guess, then
    # warned on stderr that it had to gather them back)
    chosen = jaxinfer("run", "--devices", "2", "--choice", "yes,no", "-n", "4", "--no-stats", "Is it? Answer:")
    assert chosen.returncode == 0 and chosen.stdout.strip() in ("yes", "no"), chosen.stderr
    assert "rematerialization" not in chosen.stderr, chosen.stderr
    facts = json.loads(
        jaxinfer(
            "info", "-m", paths["llama"], "--devices", "4", "--json", "--peak-flops", "1e11", "--peak-bandwidth", "1e10"
        ).stdout
    )
    # info's sums, from the config alone, match the arrays'
    assert facts["weight_bytes_per_device"] == max(results["llama"]["4"]["bytes"])
    assert facts["kv_bytes_per_token_per_device"] == facts["kv_bytes_per_token"] / 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_join_one_mesh(sharded, tmp_path):
    """Two `jaxinfer run` processes with 2 CPU devices each, joined on loopback by jax.distributed
    (gloo), give one process's tokens: the first prints them, reading the prompt from its stdin; the
    other, given no prompt at all, stays quiet. Then batch, whose input only the first can read; then
    a Ctrl-C."""
    results, paths = sharded
    coordinator = f"127.0.0.1:{_free_port()}"

    def start(i, *args, stdin=subprocess.DEVNULL):
        flags = ("--devices", "4", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i))
        return subprocess.Popen(
            ["jaxinfer", *map(str, args), *flags],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    run = ("run", "-m", paths["llama"], *RUN, "--json", "-")
    first, other = start(0, *run, stdin=subprocess.PIPE), start(1, *run)
    out, err = first.communicate(LONG, timeout=300)
    assert first.returncode == 0, err
    assert json.loads(out)["token_ids"] == results["llama"]["1"]["run"]
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0 and out == "" and err == "", err

    requests = tmp_path / "in.jsonl"
    requests.write_text(
        "".join(
            json.dumps({"id": i, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}) + "\n"
            for i, (p, n) in BATCH.items()
        )
    )
    coordinator = f"127.0.0.1:{_free_port()}"
    batch = ("-m", paths["llama"], "-b", "2", "-c", "256", "-o", tmp_path / "out.jsonl")
    first, other = start(0, "batch", requests, *batch), start(1, "batch", tmp_path / "absent.jsonl", *batch)
    assert first.wait(timeout=300) == 0 and other.wait(timeout=300) == 0, first.stderr.read() + other.stderr.read()
    records = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    assert {r["id"]: r["text"] for r in records} == results["llama"]["1"]["batch"]

    coordinator = f"127.0.0.1:{_free_port()}"  # Ctrl-C in the first stops both at the next chunk, the text so far kept
    run = ("run", "-m", paths["llama"], "-c", "256", "-n", "250", "--temp", "0", "--ignore-eos", "x")
    first, other = start(0, *run), start(1, *run)
    assert first.stdout.read(1)  # streaming
    first.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    assert first.wait(timeout=120) == 130 and other.wait(timeout=120) == 130, first.stderr.read() + other.stderr.read()
    assert time.monotonic() - interrupted < 30  # not JAX's heartbeat timeout (100 s), nor its shutdown barrier's
    stats = first.stderr.read()
    assert "finish: interrupted" in stats and int(re.search(r"decode: +(\d+) tokens", stats).group(1)) < 249, stats
    assert other.stderr.read() == ""


def test_missing_process(tiny):
    """A process whose peers never come says so and stops (JAX itself would abort with a stack trace)."""
    proc = jaxinfer(
        "run",
        "-m",
        tiny(),
        "--coordinator",
        f"127.0.0.1:{_free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--join-timeout",
        "2",
        "x",
    )
    assert_one_line_error(proc, "not every process joined", "within 2 s")
