"""Every kind of bad input to the real `jaxinfer` command is one line + exit ≠ 0: missing or damaged
weights, flags out of range, prompts beyond the context, bytes that are not UTF-8, outputs that
cannot be written."""

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.fixture
def broken(model, tmp_path):
    """A copy of the model directory to damage."""

    def copy():
        target = tmp_path / "broken"
        shutil.copytree(model, target)
        return target

    return copy


def test_missing_and_empty_model_directories(tmp_path):
    assert_one_line_error(jaxinfer_here("run", "-m", tmp_path / "nope", "hi"), "does not exist")
    assert_one_line_error(jaxinfer_here("run", "-m", tmp_path, "hi"), "config.json")


def test_truncated_safetensors(broken):
    path = broken()
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(jaxinfer_here("run", "-m", path, "hi"), "corrupt")


def test_garbage_safetensors(broken):
    path = broken()
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    assert_one_line_error(jaxinfer_here("run", "-m", path, "hi"), "corrupt")


@pytest.mark.slow
def test_config_weights_mismatch(broken):
    path = broken()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert_one_line_error(jaxinfer_here("run", "-m", path, "hi"), "mlp", "shape")
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert_one_line_error(jaxinfer_here("run", "-m", path, "hi"), "missing tensor model.layers.2")
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert_one_line_error(jaxinfer_here("run", "-m", path, "hi"), "model.layers.1")


def test_unknown_architecture_lists_the_supported_ones(broken):
    path = broken()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(
        jaxinfer("run", "-m", path, "hi"), "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM"
    )


@pytest.mark.slow
def test_prompt_beyond_context_empty_prompt_and_bad_flags(model):
    assert_one_line_error(
        jaxinfer("run", "-m", model, "The capital of France is", "-n", "100", "-c", "64"), "exceeds the context"
    )
    assert_one_line_error(jaxinfer_here("run", "-m", model, "   "), "empty")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "--temp", "-1"), "--temp")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "--top-p", "0"), "--top-p")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "--dtype", "int4"), "--dtype")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "--max-tokens", "many"), "--max-tokens")
    assert_one_line_error(jaxinfer_here("batch", "-m", model, "-", "--prefill-chunk", "8"), "--prefill-chunk")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "--no-such-flag"), "--no-such-flag")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_output_that_cannot_be_written_and_closed_streams_are_one_line(model, tmp_path):
    """A full disk (/dev/full), a closed stdout or stdin: what happened, in one line; a batch writing
    to stdout has written each record as it finished; --resume refuses what is not a regular file."""
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": "Hi", "max_tokens": 2}) + "\n" for i in range(3))
    )
    cases = {
        "full": (["run", "-m", model, "hi", "-n", "3"], {"stdout": open("/dev/full", "w")}, "No space left on device"),
        "batch full": (
            ["batch", tmp_path / "in.jsonl", "-m", model],
            {"stdout": open("/dev/full", "w")},
            "No space left",
        ),
        "stdout closed": (
            ["run", "-m", model, "hi", "-n", "3"],
            {"stdout": subprocess.DEVNULL, "close": 1},
            "stdout is closed",
        ),
        "stdin closed": (
            ["run", "-m", model, "-", "-n", "3"],
            {"stdout": subprocess.PIPE, "close": 0},
            "stdin is closed",
        ),
    }
    for name, (args, how, words) in cases.items():
        close = how.pop("close", None)
        proc = subprocess.run(
            ["jaxinfer", *map(str, args)],
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "JAXINFER_CACHE_DIR": ""},
            preexec_fn=(lambda fd=close: os.close(fd)) if close is not None else None,
            **how,
        )
        assert_one_line_error(proc, words)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = jaxinfer("batch", tmp_path / "in.jsonl", "-m", model, "-o", fifo, "--resume")
    assert_one_line_error(proc, "not a regular file", "--resume")
    # a reader that stops early (| head): the run ends quietly
    piped = subprocess.run(
        f"jaxinfer run -m {shlex.quote(str(model))} hi -n 60 --no-stats | head -c 3",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in piped.stderr and "error" not in piped.stderr


@pytest.mark.slow
def test_a_damaged_converted_checkpoint_is_one_line_naming_it(model, tmp_path):
    """Each file orbax keeps cut in half: one line that says the checkpoint is damaged and where (not
    TensorStore's page of detail, not asyncio's tracebacks, not "does not match config.json")."""
    converted = tmp_path / "converted"
    assert jaxinfer("convert", model, converted).returncode == 0
    params = converted / "params"
    damaged = [params / "_METADATA", params / "_sharding", params / "manifest.ocdbt"]
    damaged += [p for p in (params / "array_metadatas").iterdir()] + [p for p in (params / "d").iterdir()]
    for path in damaged:
        copy = tmp_path / f"copy-{path.name}"
        shutil.copytree(converted, copy)
        target = copy / path.relative_to(converted)
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        proc = jaxinfer("run", "-m", copy, "hi", "-n", "2")
        assert_one_line_error(proc, "damaged")
        assert "does not match" not in proc.stderr
    config = json.loads((converted / "config.json").read_text())
    (converted / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    assert_one_line_error(jaxinfer_here("run", "-m", converted, "hi"), "does not match config.json", "stored shape")


@pytest.mark.slow
def test_every_numeric_option_is_range_checked(model, tmp_path):
    """Each value that would never advance a loop, divide by zero or mean nothing: one line naming the
    flag (perplexity -c 1 used to append windows forever)."""
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. " * 20)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"id": 1, "prompt": "hi"}\n')
    cases = [
        (("perplexity", text, "-c", "1"), "--max-context must be at least 2"),
        (("perplexity", text, "--stride", "0"), "--stride"),
        (("run", "hi", "-n", "0"), "--max-tokens"),
        (("run", "hi", "-c", "0"), "--max-context"),
        (("run", "hi", "--top-p", "0"), "--top-p"),
        (("run", "hi", "--min-p", "2"), "--min-p"),
        (("run", "hi", "--repeat-penalty", "0"), "--repeat-penalty"),
        (("run", "hi", "--temp", "nan"), "--temp"),
        (("run", "hi", "--logit-bias", "5+inf"), "--logit-bias"),
        (("run", "hi", "-l", "99999999-1"), "--logit-bias"),
        (("run", "hi", "--peak-flops", "-5"), "--peak-flops"),
        (("run", "hi", "--peak-bandwidth", "0"), "--peak-bandwidth"),
        (("bench", "-r", "0"), "--repeat"),
        (("bench", "-b", "0"), "--batch-size"),
        (("info", "-p", "0"), "--prompt-tokens"),
        (("batch", jsonl, "-b", "0"), "--batch-size"),
    ]
    for (command, *args), words in cases:  # in this process: 14 process starts took 12 s
        assert_one_line_error(jaxinfer_here(command, "-m", model, *args), words)


@pytest.mark.slow
def test_bytes_that_are_not_utf8_a_missing_backend_and_a_cache_beyond_memory(model, tmp_path):
    proc = subprocess.run(
        ["jaxinfer", "run", "-m", str(model), "-"], input=b"caf\xe9 \xff", capture_output=True, timeout=300
    )
    assert_one_line_error(
        subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode()),
        "not valid UTF-8",
    )
    assert_one_line_error(jaxinfer("run", "-m", model, "hi", env={"JAX_PLATFORMS": "cuda"}), "JAX_PLATFORMS", "cpu")
    proc = jaxinfer("run", "-m", model, "hi", "-c", "1000000000")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    warning, error = proc.stderr.strip().splitlines()  # nothing allocated: XLA would have tried terabytes
    assert (
        "beyond the 256 positions" in warning
        and error.startswith("error: a 1000000000-position cache")
        and "longest context that fits" in error
    )


@pytest.mark.slow
def test_batch_outputs_that_cannot_be_written_and_lines_that_are_not_utf8(model, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(
        b'{"id": 1, "prompt": "caf\xe9"}\n{"id": 2, "prompt": "Hello", "max_tokens": 3}\n'
        b'{"id": "\\udcff", "prompt": "x", "max_tokens": 2}\n'
    )
    assert_one_line_error(jaxinfer_here("batch", inp, "-o", tmp_path, "-m", model), "is a directory")
    assert_one_line_error(
        jaxinfer_here("batch", inp, "-o", tmp_path / "missing" / "out.jsonl", "-m", model), "cannot write"
    )
    proc = jaxinfer("batch", inp, "-m", model, "-b", "10000000", "-c", "256")  # slots capped by the 3 requests
    assert proc.returncode == 1, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records[0] == {"id": None, "line": 1, "error": "the line is not UTF-8 text"}
    assert {r["id"] for r in records[1:]} == {2, "\udcff"} and all("text" in r for r in records[1:])
