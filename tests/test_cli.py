"""The real `jaxinfer` command's output contracts: JSON and streamed text, prompt sources, flags people
bring from llama.cpp and mlx-lm, the compile cache, a terminal's spinner, Ctrl-C (bad input:
test_bad_input.py; installing: test_install.py)."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

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


@pytest.mark.slow
def test_convert_then_run_the_converted_model(model, tmp_path):
    out = tmp_path / "converted"
    proc = jaxinfer("convert", model, out)
    assert proc.returncode == 0, proc.stderr
    original = json.loads(jaxinfer("run", "-m", model, "Paris", "-n", "8", "--temp", "0", "--json").stdout)
    converted = json.loads(jaxinfer("run", "-m", out, "Paris", "-n", "8", "--temp", "0", "--json").stdout)
    assert converted["token_ids"] == original["token_ids"]
    assert_one_line_error(jaxinfer_here("convert", model, out), "not empty")


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
    noted = jaxinfer("run", "-m", model, "hi", "-n", "1", "-fa", "--jinja", "--no-color", "--no-stats")
    assert noted.returncode == 0 and "-fa does not apply" in noted.stderr and "--jinja does not apply" in noted.stderr
    assert_one_line_error(jaxinfer("run", "-m", model, "hi", "-cnv"), "here that is `jaxinfer chat`")
    assert_one_line_error(jaxinfer("run", "-m", model / "config.json", "hi"), "-m takes the model's directory")
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
def test_no_stats_measures_no_roofs(model, tmp_path):
    """On a machine never measured, --no-stats (with --json too) costs no probe of its roofs."""
    fresh = {"XDG_CACHE_HOME": str(tmp_path / "fresh")}
    proc = jaxinfer("run", "-m", model, "hi", "-n", "2", "--json", "--no-stats", env=fresh)
    assert proc.returncode == 0 and "measuring" not in proc.stderr, proc.stderr
    assert "roofline" not in json.loads(proc.stdout)["timings"]


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


@pytest.mark.parametrize(
    "args, kept, said",
    [
        (["run", "hi", "-fa"], ["run", "hi"], "-fa does not apply"),
        (["run", "-fa", "on", "hi"], ["run", "hi"], "-fa does not apply"),
        (["run", "--flash-attn=auto", "hi"], ["run", "hi"], "--flash-attn does not apply"),
        (["chat", "-cnv", "--jinja"], ["chat"], "--jinja does not apply"),
        (["run", "hi", "--repeat-last-n", "64", "--mirostat", "0"], ["run", "hi"], "--repeat-last-n does not apply"),
        (["run", "hi", "--no-display-prompt"], ["run", "hi"], "printed only with --echo"),
        (["run", "--", "-fa"], ["run", "--", "-fa"], ""),  # after --, a prompt
        (["run", "hi", "-cnv"], None, "here that is `jaxinfer chat`"),
        (["run", "hi", "-i"], None, "conversation mode"),
        (["run", "hi", "--mirostat", "2"], None, "mirostat sampling is not offered"),
    ],
)
def test_llama_cpp_flags_are_answered_not_misread(args, kept, said, capsys):
    """click read -fa as -f a ("cannot read a") and -cnv as -c nv; each is answered as -ngl is."""
    from jaxinfer.cli.main import _llama_cpp_flags
    from jaxinfer.errors import JaxinferError

    if kept is None:
        with pytest.raises(JaxinferError, match=re.escape(said)):
            _llama_cpp_flags(args)
        return
    assert _llama_cpp_flags(args) == kept
    assert said in capsys.readouterr().err
