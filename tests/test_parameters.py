"""The library speaks parameters, the CLI speaks flags: a library error names the parameters it is
about (`JaxinferError.names`), and the CLI's one table (`cli.options.FLAGS`) says them as flags."""

import ast
from pathlib import Path

import pytest

import jaxinfer
from jaxinfer.cli import options
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import open_model
from jaxinfer.sampling import Sampling

ROOT = Path(jaxinfer.__file__).parent


def _library_errors():
    """(file:line, message constants, names) of every `JaxinferError(...)` the library makes."""
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] in ("cli", "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "JaxinferError" and node.args:
                message, *names = node.args
                texts = [n.value for n in ast.walk(message) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                yield f"{path.name}:{node.lineno}", texts, names


def test_library_errors_name_parameters_and_the_cli_has_a_flag_for_each():
    errors = list(_library_errors())
    assert len(errors) > 50  # the scan sees them
    flags = [(where, text) for where, texts, _ in errors for text in texts if "--" in text]
    assert flags == [], "library errors must name parameters, not the CLI's flags"
    # names given as constants (Sampling names its fields from a table: the next test)
    named = {(where, n.value) for where, _, names in errors for n in names if isinstance(n, ast.Constant)}
    assert len(named) > 20
    assert {name for _, name in named} - set(options.FLAGS) == set(), "a parameter the CLI has no word for"
    for where, name in named:  # each name given is in its message
        texts = next(texts for w, texts, _ in errors if w == where)
        assert any(name in text for text in texts), (where, name)


def test_the_cli_says_a_parameter_as_its_flag_and_leaves_other_words_alone():
    e = JaxinferError("the prompt (9 tokens) + max_tokens (8) exceeds max_context 16; lower max_tokens", "max_tokens")
    assert str(e) == "the prompt (9 tokens) + max_tokens (8) exceeds max_context 16; lower max_tokens"
    assert options.worded(e) == "the prompt (9 tokens) + --max-tokens (8) exceeds max_context 16; lower --max-tokens"
    # only whole names: kv_dtype is not dtype
    e = JaxinferError("kv_dtype and dtype disagree", "dtype", "kv_dtype")
    assert options.worded(e) == "--kv-dtype and --dtype disagree"
    for field, flag in [("temperature", "--temp"), ("top_k", "--top-k"), ("top_p", "--top-p"), ("min_p", "--min-p")]:
        with pytest.raises(JaxinferError) as e:
            Sampling(**{field: -1})
        assert str(e.value).startswith(f"{field} must be") and options.worded(e.value).startswith(f"{flag} must be")
    assert options.worded(JaxinferError("no names here: max_tokens")) == "no names here: max_tokens"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"num_draft": 3}, "num_draft needs speculate ngram or draft_model"),
        ({"speculate": "ngram", "num_draft": 40}, "num_draft must be between 1 and 32"),
        ({"speculate": "medusa"}, "speculate must be one of ngram, not 'medusa'"),
        ({"speculate": "ngram", "draft_model": "x"}, "speculate ngram and draft_model are two ways to draft"),
        ({"prefill_chunk": 8}, "prefill_chunk must be 0 (off) or at least 16"),
        ({"max_context": 0}, "max_context must be at least 1"),
    ],
)
def test_open_model_checks_every_parameter_before_reading_a_model(tmp_path, params, message):
    with pytest.raises(JaxinferError, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_model(tmp_path / "not-a-model", **params)  # the path is never looked at


def test_open_model_gives_the_decoding_and_context_every_command_runs_with(tiny):
    path = tiny("llama")
    opened = open_model(path, speculate="ngram", prefill_chunk=32)
    assert opened.decoding.speculating and opened.decoding.speculation.draft == 4
    assert opened.decoding.prefill_chunk == 32 and opened.decoding.draft_params is None
    assert opened.context == min(opened.model.max_positions, 4096)
    drafted = open_model(path, draft_model=path, num_draft=2, max_context=64)
    assert drafted.decoding.speculation.draft == 2 and drafted.decoding.speculation.model == drafted.model.config
    assert drafted.decoding.draft_params is not None and drafted.context == 64
    assert not open_model(path).decoding.speculating
