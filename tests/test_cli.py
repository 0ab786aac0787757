"""The real `jaxinfer` command: output contracts, and every kind of bad input is one line + exit ≠ 0."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here

from jaxinfer import kernel


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.mark.slow
def test_json_output_and_stdin_prompt(model):
    proc = jaxinfer(
        "run",
        "-m",
        model,
        "-",
        "--json",
        "-n",
        "12",
        "--seed",
        str(2**32 + 5),
        "--temp",
        "0.8",
        stdin="The capital of France is",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"text", "token_ids", "prompt_tokens", "generated_tokens", "finish_reason", "seed", "timings"}
    assert result["seed"] == 2**32 + 5 and result["finish_reason"] in ("eos", "length")  # any integer is a seed
    assert set(result["timings"]) >= {"ttft_s", "prefill_tok_s", "decode_tok_s", "itl_ms", "compile_s", "roofline"}
    roofline = result["timings"]["roofline"]
    assert roofline["prefill"]["mfu"] > 0 and roofline["decode"]["mbu"] > 0 and roofline["decode"]["bound"] == "memory"
    assert "TTFT" in proc.stderr and "MFU" in proc.stderr and "MBU" in proc.stderr
    # float matrices: packed for a vectorised path, else XLA's layouts
    ran = kernel.isa() if kernel.vectorised() else "XLA"
    assert result["timings"]["kernels"] == ran and f"matrices on {ran}" in proc.stderr


@pytest.mark.slow
def test_streamed_stdout_equals_json_text_and_compile_cache_is_reused(model, tmp_path):
    args = ("run", "-m", model, "The capital of France is", "-n", "24", "--temp", "0")
    streamed = jaxinfer(*args, cache=tmp_path)
    as_json = jaxinfer(*args, "--json", cache=tmp_path)
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"
    assert "(compiled)" in streamed.stderr
    assert json.loads(as_json.stdout)["timings"]["compile_cache"] == "hit"


@pytest.mark.slow
def test_a_home_that_cannot_be_written_only_costs_the_caches(model, tmp_path):
    home = tmp_path / "home"
    home.write_text("a file: no directory can be made under it, even by root")
    env = {k: v for k, v in os.environ.items() if k not in ("JAXINFER_CACHE_DIR", "XDG_CACHE_HOME")} | {
        "HOME": str(home)
    }
    proc = subprocess.run(
        ["jaxinfer", "run", "-m", model, "Hello", "-n", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["generated_tokens"] >= 1  # the roofs measured, not stored
    assert proc.stderr.count("warning: no compile cache") == 1 and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout, as `pip install .` builds it (without the compiled kernels: setup.py
    is left out, so the build takes seconds)."""
    pytest.importorskip("setuptools")
    repo, tmp_path = Path(__file__).parent.parent, tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    for name in ("jaxinfer", "cli", "models"):
        shutil.copytree(repo / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    return next(tmp_path.glob("jaxinfer-*.whl"))


def test_the_wheel_installs_the_front_end_inside_jaxinfer(wheel):
    """No top-level `cli` package another distribution could shadow, or lose when uninstalled."""
    wheel = zipfile.ZipFile(wheel)
    assert {name.split("/")[0] for name in wheel.namelist()} == {
        "jaxinfer",
        wheel.filename.split("/")[-1].split("-py3")[0] + ".dist-info",
    }
    assert "jaxinfer/cli/main.py" in wheel.namelist() and "jaxinfer/__main__.py" in wheel.namelist()
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "jaxinfer = jaxinfer.cli.main:main" in wheel.read(entry_points).decode()


@pytest.mark.slow
def test_the_suite_run_in_a_checkout_tests_a_plain_install(wheel, tmp_path):
    """After `pip install .` (not -e), `python -m pytest` in the checkout puts the checkout's jaxinfer/
    first on the path, which has no jaxinfer.cli nor jaxinfer.models: conftest takes the install."""
    import sysconfig

    installed = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", installed, wheel]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    # -S: no site, so no .pth file maps jaxinfer to this checkout as the editable install does; the
    # dependencies still come from the environment's site-packages
    paths = dict.fromkeys([installed, *(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))])
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "tests/test_parameters.py",
            "-k",
            "word",
        ],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"jaxinfer from {installed / 'jaxinfer'} (installed), kernels: not built" in proc.stdout


def test_version_python_dash_m_and_a_bare_command_showing_help():
    version = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "--version"], capture_output=True, text=True, timeout=300
    )
    assert version.returncode == 0 and version.stdout.startswith("jaxinfer ")
    bare = jaxinfer()
    assert bare.returncode == 0 and "Commands:" in bare.stdout and "run" in bare.stdout and not bare.stderr


@pytest.mark.slow
def test_every_command_help_ends_with_examples_that_parse():
    """In this process (the command's own app; a process each took 17 s): the real command's help is
    shown by the other tests."""
    from typer.testing import CliRunner

    from jaxinfer.cli.main import EXAMPLES, app

    runner = CliRunner()
    for command, lines in EXAMPLES.items():
        assert runner.invoke(app, [command, "--help"]).stdout.rstrip().endswith(lines[-1])
        for line in lines:
            words = shlex.split(line.split("|")[-1].split(">")[0])[1:]  # the jaxinfer part of a pipeline
            shown = runner.invoke(app, [*words, "--help"])  # click checks every flag before it shows the help
            assert shown.exit_code == 0 and not shown.stderr, (line, shown.stderr, shown.exception)


@pytest.mark.slow
def test_bundled_model_is_the_default_from_any_directory(tmp_path):
    from jaxinfer.modeldir import bundled_model_dir

    prompt = "def fibonacci(n):" + " " * 300  # longer than a file name may be: not taken for a model directory
    args = ("run", prompt, "-n", "16", "--temp", "0", "--json")
    default = jaxinfer(*args, cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    explicit = jaxinfer(*args, "-m", bundled_model_dir())
    assert json.loads(default.stdout)["token_ids"] == json.loads(explicit.stdout)["token_ids"]


@pytest.mark.slow
def test_convert_then_run_the_converted_model(model, tmp_path):
    out = tmp_path / "converted"
    proc = jaxinfer("convert", model, out)
    assert proc.returncode == 0, proc.stderr
    original = json.loads(jaxinfer("run", "-m", model, "Paris", "-n", "8", "--temp", "0", "--json").stdout)
    converted = json.loads(jaxinfer("run", "-m", out, "Paris", "-n", "8", "--temp", "0", "--json").stdout)
    assert converted["token_ids"] == original["token_ids"]
    assert_one_line_error(jaxinfer_here("convert", model, out), "not empty")


@pytest.fixture
def broken(model, tmp_path):
    """A copy of the model directory to damage."""

    def copy():
        target = tmp_path / "broken"
        shutil.copytree(model, target)
        return target

    return copy


@pytest.mark.slow
def test_hub_ids_from_the_local_hub_cache_offline(model, tmp_path):
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-llama"
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    offline = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    local = jaxinfer("run", "-m", model, "Hello", "-n", "4", "--temp", "0", "--json")
    for name in ("acme/tiny-llama", "acme/tiny-llama@main"):
        proc = jaxinfer("run", "-m", name, "Hello", "-n", "4", "--temp", "0", "--json", env=offline)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert_one_line_error(
        jaxinfer("run", "-m", "acme/missing", "Hello", env=offline), "acme/missing", str(cache), "HF_HUB_OFFLINE"
    )
    assert jaxinfer("convert", "acme/tiny-llama", tmp_path / "converted", env=offline).returncode == 0
    proc = jaxinfer("run", "-m", tmp_path / "converted", "Hello", "-n", "4", "--temp", "0", "--json")
    assert json.loads(proc.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]


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
def test_prompt_from_p_f_or_stdin_and_escapes(model, tmp_path):
    from jaxinfer.cli.options import unescape

    assert unescape(r"a\n\tb\\n \"q\" \x") == 'a\n\tb\\n "q" \\x'  # llama.cpp's set; others stay as typed
    (tmp_path / "prompt.txt").write_text("The capital\tof France is")
    results = [
        jaxinfer_here("run", "-m", model, *args, "-n", "6", "--temp", "0", "--json", stdin=stdin)
        for args, stdin in (
            (["-p", "The capital\\tof France is"], None),
            (["-f", tmp_path / "prompt.txt"], None),
            (["The capital\\tof France is"], None),
            (["-"], "The capital\tof France is"),
        )
    ]
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    # one prompt, four ways
    assert len({(json.loads(r.stdout)["prompt_tokens"], json.loads(r.stdout)["text"]) for r in results}) == 1
    verbatim = jaxinfer_here(
        "run", "-m", model, "The capital\\tof France is", "--no-escape", "-n", "6", "--temp", "0", "--json"
    )
    assert json.loads(verbatim.stdout)["prompt_tokens"] != json.loads(results[0].stdout)["prompt_tokens"]
    assert_one_line_error(jaxinfer_here("run", "-m", model, "hi", "-p", "hi"), "give the prompt once")
    assert_one_line_error(jaxinfer_here("run", "-m", model, "-f", tmp_path / "missing.txt"), "cannot read")


@pytest.mark.slow
def test_global_flags_after_the_command_and_a_model_directory_given_as_the_prompt(model, tmp_path):
    for args, env in ((("--debug",), {}), ((), {"JAXINFER_DEBUG": "1"})):
        proc = jaxinfer("run", "-m", tmp_path / "missing", "hi", *args, env=env)
        assert proc.returncode != 0 and "Traceback" in proc.stderr, proc.stderr
    cache = tmp_path / "compiled"
    assert jaxinfer("run", "-m", model, "hi", "-n", "2", "--compile-cache", cache).returncode == 0
    assert any(cache.iterdir())
    assert_one_line_error(jaxinfer_here("run", model), "is a directory", f"-m {model}")
    # XLA's pool sized by the cores pinned
    assert jaxinfer("run", "-m", model, "hi", "-n", "2", "-t", "1").returncode == 0
    assert_one_line_error(jaxinfer("run", "-m", model, "hi", "-t", str(os.cpu_count() + 1)), "-t/--threads")


@pytest.mark.slow
def test_flags_people_bring_from_llama_cpp_and_mlx_lm(model, tmp_path):
    """-s, --n-predict, -e, --system-prompt / -sys, --verbose, --color / --no-color, and -ngl (which
    does not apply: a note saying so and what does, not "-n gl is not an integer")."""
    args = ("run", "-m", model, "The capital of", "--json", "--temp", "0.9")
    first = jaxinfer_here(*args, "-s", "7", "--n-predict", "5", "-e")
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert result["seed"] == 7 and result["generated_tokens"] == 5
    again = json.loads(jaxinfer_here(*args, "--seed", "7", "-n", "5").stdout)
    assert again["token_ids"] == result["token_ids"]
    noted = jaxinfer("run", "-m", model, "hi", "-n", "1", "-ngl", "99", "--no-color", "--no-stats")
    assert noted.returncode == 0 and "-ngl 99 does not apply" in noted.stderr and "\x1b[" not in noted.stderr
    failing = jaxinfer("run", "-m", tmp_path / "missing", "hi", "--verbose")
    assert failing.returncode != 0 and "Traceback" in failing.stderr
    # --system-prompt: the prompt as one chat turn, the template's (here the fallback's) rendering
    from jaxinfer.chat_template import FALLBACK_TEMPLATE, ChatTemplate
    from jaxinfer.loading import load_model

    loaded = load_model(model)
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = loaded.tokenizer.encode(
        ChatTemplate(FALLBACK_TEMPLATE, loaded.tokenizer.special_tokens).render(turn), add_special_tokens=False
    )
    for flag in ("--system-prompt", "-sys"):
        proc = jaxinfer_here("run", "-m", model, "Hi", flag, "Be brief.", "-n", "2", "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["prompt_tokens"] == len(expected), proc.stderr


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
def test_no_stats_measures_no_roofs(model, tmp_path):
    """On a machine never measured, --no-stats (with --json too) costs no probe of its roofs."""
    fresh = {"XDG_CACHE_HOME": str(tmp_path / "fresh")}
    proc = jaxinfer("run", "-m", model, "hi", "-n", "2", "--json", "--no-stats", env=fresh)
    assert proc.returncode == 0 and "measuring" not in proc.stderr, proc.stderr
    assert "roofline" not in json.loads(proc.stdout)["timings"]


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


@pytest.mark.slow
def test_a_terminal_sees_a_spinner_until_the_first_token(model):
    import pexpect

    env = {**os.environ, "JAXINFER_CACHE_DIR": "", "TERM": "xterm", "COLUMNS": "120"}
    child = pexpect.spawn(
        "jaxinfer", ["run", "-m", str(model), "Hello", "-n", "4", "--no-stats"], encoding="utf-8", timeout=300, env=env
    )
    child.expect_exact("compiling and prefilling")  # while the first compile runs
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before
    # Ctrl-C while it compiles (held until the compile ends): said so, not a line of zero figures
    args = ["run", "-m", str(model), "Hello", "-n", "4"]
    child = pexpect.spawn("jaxinfer", args, encoding="utf-8", timeout=300, env=env)
    child.expect_exact("compiling and prefilling")
    child.sendintr()
    child.expect_exact("interrupted before the first token")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and "TTFT" not in child.before and "Traceback" not in child.before


@pytest.mark.slow
def test_ctrl_c_stops_generation_at_once_and_keeps_the_text(tiny, tmp_path):
    slow = tiny("llama", hidden_size=256, num_hidden_layers=4, max_position_embeddings=8192)
    args = ["run", "-m", slow, "The capital", "-c", "8192", "--temp", "0", "--ignore-eos"]
    # Ctrl-C is held while a program compiles (XLA cannot be interrupted safely): a first run fills a
    # compile cache (and the machine's roofs), so that here it lands in the decode loop.
    assert jaxinfer(*args, "-n", "600", cache=tmp_path).returncode == 0
    proc = subprocess.Popen(
        ["jaxinfer", *map(str, args), "-n", "8000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "JAXINFER_CACHE_DIR": str(tmp_path)},
    )
    first = proc.stdout.read(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    interrupted = time.perf_counter()
    rest, err = proc.communicate(timeout=60)
    assert time.perf_counter() - interrupted < 2.0
    assert proc.returncode == 130, err
    assert first and "finish: interrupted" in err.decode() and "Traceback" not in err.decode()
    assert len(first + rest) > 1
