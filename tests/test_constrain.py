"""Constrained decoding: every output of a suite of 20 JSON schemas parses and validates
(`jsonschema`, not ours, is the judge) on the bundled model, greedy and sampled, alone and in one
mixed batch; regex, choice and grammars; a constrained row's batch-mates and speculation unchanged;
no recompile per schema; bad constraints one line each."""

import json
import re

import jsonschema
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here

from jaxinfer.constrain import Constraint, closed, from_request
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.runtime import watch_compiles
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

PROMPT = "import json\n\nCONFIG = "
NAME = {"type": "string", "maxLength": 12}
SMALL = {"type": "integer", "minimum": 0, "maximum": 999}


def _object(properties: dict, required=None, **more) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **more,
    }


SCHEMAS = [
    _object({"name": NAME}),
    _object({"ok": {"type": "boolean"}}),
    _object({"n": SMALL}),
    _object({"x": {"type": "number", "minimum": -10, "maximum": 10}}),
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"kind": {"const": "point"}, "x": SMALL, "y": SMALL}),
    _object({"tags": {"type": "array", "items": NAME, "maxItems": 3}}),
    _object({"pair": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2}}),
    _object({"inner": _object({"a": SMALL, "b": {"type": "boolean"}})}),
    _object({"outer": _object({"inner": _object({"leaf": NAME})})}),
    _object({"name": NAME, "age": SMALL, "email": NAME}, required=["name"]),  # optional fields
    _object({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    _object({"v": {"anyOf": [SMALL, {"type": "boolean"}]}}),
    _object({"items": {"type": "array", "items": _object({"id": SMALL}), "maxItems": 2}}),
    _object({"p": {"$ref": "#/$defs/point"}}, **{"$defs": {"point": _object({"x": SMALL, "y": SMALL})}}),
    _object({"a": {"$ref": "#/$defs/id"}, "b": {"$ref": "#/$defs/id"}}, **{"$defs": {"id": SMALL}}),
    _object({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    _object({"score": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9}}),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
    _object({"mode": {"enum": ["a", "b"]}, "level": {"type": "integer", "minimum": 1, "maximum": 3}}),
]


@pytest.fixture(scope="module")
def bundled():
    return load_model()


def _generate(model, engine, constraint, sampling=Sampling(), seed=0, max_tokens=160, **kw) -> Generation:
    gen = Generation(model, engine, PROMPT, sampling, max_tokens, seed, constraint=constraint, **kw)
    list(gen)
    return gen


def test_the_schema_suite_always_parses_and_validates(bundled):
    """20 schemas (nested objects, arrays, enums, bounds, optional fields, $defs, anyOf, patterns),
    each greedy and sampled: every output is JSON its schema validates, ended by the match."""
    assert len(SCHEMAS) == 20
    engine = Engine(bundled.config, bundled.params, 512, bundled.eos_ids)
    hot = Sampling(temperature=1.0, top_p=0.95)
    for i, schema in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        for sampling in (Sampling(), hot):
            gen = _generate(bundled, engine, Constraint("json_schema", schema), sampling, seed=i)
            assert gen.finish_reason in ("stop", "eos"), (schema, gen.text, gen.finish_reason)
            jsonschema.validate(json.loads(gen.text), schema)


def test_objects_admit_no_keys_they_do_not_name_unless_they_say(bundled):
    """The issue's schema, without "additionalProperties": sampled, 4 of 15 answers ran to the limit
    adding keys JSON Schema's default admits; closed as OpenAI's strict mode reads it, none does."""
    person = {"type": "object", "properties": {"name": NAME, "age": SMALL}, "required": ["name", "age"]}
    engine = Engine(bundled.config, bundled.params, 512, bundled.eos_ids)
    for seed in range(6):
        gen = _generate(bundled, engine, Constraint("json_schema", person), Sampling(temperature=1.0), seed, 120)
        assert gen.finish_reason in ("stop", "eos") and set(json.loads(gen.text)) == {"name", "age"}, gen.text
    nested = {"$defs": {"p": person}, "anyOf": [{"$ref": "#/$defs/p"}, {"type": "array", "items": person}]}
    said = {**person, "additionalProperties": True}
    composed = {"allOf": [person, {"properties": {"id": SMALL}}]}
    assert closed(nested)["$defs"]["p"]["additionalProperties"] is False
    assert closed(nested)["anyOf"][1]["items"]["additionalProperties"] is False
    assert closed(said) == said and closed(composed) == composed  # asked for, or each would refuse the other
    assert closed({"type": "object"}) == {"type": "object"}  # any object: nothing named, nothing closed


def test_no_key_twice_even_where_the_grammar_would_allow_it(bundled):
    """Keys of one letter, two to four of them: llguidance's grammar wrote {"g":0,"g":0,"g":0,...}
    (parsed, one key: the schema it was made under broken). The kernels refuse a key its object
    holds, and look one token ahead where few tokens go on, so a row does not begin a key that can
    only close as one it has ("g" then only '"'). Greedy and sampled, plain and speculating."""
    letters = {"type": "object", "patternProperties": {"^[a-z]$": SMALL}, "minProperties": 2, "maxProperties": 4}

    def no_repeats(pairs):
        assert len({k for k, _ in pairs}) == len(pairs), pairs
        return dict(pairs)

    for spec in (0, 4):
        decoding = Decoding(speculation=Speculation(draft=spec)) if spec else Decoding()
        engine = Engine(bundled.config, bundled.params, 512, bundled.eos_ids, decoding)
        for seed in range(4):
            sampling = Sampling(temperature=1.0) if seed else Sampling()
            gen = _generate(bundled, engine, Constraint("json_schema", letters), sampling, seed, 80)
            assert gen.finish_reason in ("stop", "eos"), gen.text
            jsonschema.validate(json.loads(gen.text, object_pairs_hook=no_repeats), closed(letters))


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
def test_the_schema_suite_in_one_mixed_batch(bundled):
    """All 20 schemas greedy and sampled, with free rows among them, through one batch of 8 slots:
    every constrained record validates, and each equals its row's run alone (checked for a few)."""
    prompt = bundled.tokenizer.encode(PROMPT)
    hot = Sampling(temperature=1.0, top_p=0.95)
    requests = [
        Request((i, s.temperature), prompt, s, 160, i, constraint=Constraint("json_schema", schema))
        for i, schema in enumerate(SCHEMAS)
        for s in (Sampling(), hot)
    ]
    requests[5:5] = [Request(("free", i), prompt, hot, 24, i) for i in range(3)]
    records = {}
    Scheduler(bundled, 8, 512).run(requests, lambda r: records.__setitem__(r["id"], r))
    assert len(records) == len(requests)
    for (i, _), record in ((k, r) for k, r in records.items() if k[0] != "free"):
        assert record["finish_reason"] in ("stop", "eos"), record
        jsonschema.validate(json.loads(record["text"]), SCHEMAS[i])
    engine = Engine(bundled.config, bundled.params, 512, bundled.eos_ids)
    for r in requests[:2] + requests[5:6] + requests[-1:]:
        alone = Generation(bundled, engine, r.prompt_ids, r.sampling, r.max_tokens, r.seed, constraint=r.constraint)
        list(alone)
        assert records[r.id]["text"] == alone.text


def test_regex_choice_and_grammars(bundled):
    engine = Engine(bundled.config, bundled.params, 512, bundled.eos_ids)
    for seed in range(3):
        hot = Sampling(temperature=1.2)
        assert re.fullmatch(
            r"[0-9]{3}-[a-z]{2,4}",
            _generate(bundled, engine, Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), hot, seed).text,
        )
        assert _generate(bundled, engine, Constraint("choice", ("alpha", "beta", "gamma")), hot, seed).text in (
            "alpha",
            "beta",
            "gamma",
        )
    gbnf = 'root ::= "x = " digit digit? ";"\ndigit ::= [0-9]'
    assert re.fullmatch(r"x = [0-9]{1,2};", _generate(bundled, engine, Constraint("grammar", gbnf)).text)
    lark = 'start: "def " NAME "():"\nNAME: /[a-z_]{1,8}/'
    assert re.fullmatch(r"def [a-z_]{1,8}\(\):", _generate(bundled, engine, Constraint("grammar", lark)).text)
    any_object = _generate(bundled, engine, Constraint("json_object"), max_tokens=400)
    if any_object.finish_reason != "unfinished":
        assert isinstance(json.loads(any_object.text), dict)
    cut = _generate(bundled, engine, Constraint("json_schema", _object({"s": {"type": "string"}})), max_tokens=3)
    assert cut.finish_reason == "unfinished"  # the budget ran out inside the value: said so


def test_a_tokenizer_that_puts_a_space_before_the_text(tiny):
    """sentencepiece's dummy prefix (Llama 2, TinyLlama): "no" is spelled " no", and llguidance,
    told so, forced a space inside the match ("n" then " "). It is told each text without it."""
    model = load_model(tiny("llama", tokenizer="sp"))
    spelled = b"".join(model.tokenizer.token_bytes(i) for i in model.tokenizer.encode("no", add_special_tokens=False))
    assert spelled == b" no"  # the case in point
    engine = Engine(model.config, model.params, 256, model.eos_ids)
    schema = SCHEMAS[5]  # a const, two integers
    for seed, sampling in enumerate((Sampling(), Sampling(temperature=1.0), Sampling(temperature=1.0))):
        choice = _generate(model, engine, Constraint("choice", ("yes", "no", "maybe not")), sampling, seed)
        assert choice.text in ("yes", "no", "maybe not") and choice.finish_reason == "stop"
        typed = _generate(model, engine, Constraint("json_schema", schema), sampling, seed, max_tokens=200)
        assert typed.finish_reason == "stop", typed.text
        jsonschema.validate(json.loads(typed.text), schema)


def test_a_new_schema_compiles_nothing_and_logprobs_stay_inside_the_mask(bundled):
    engine = Engine(bundled.config, bundled.params, 256, bundled.eos_ids)
    _generate(bundled, engine, Constraint("json_schema", SCHEMAS[0]), max_tokens=60)  # all in one kv bucket
    with watch_compiles() as later:
        for schema in SCHEMAS[1:4]:
            _generate(bundled, engine, Constraint("json_schema", schema), max_tokens=60)
        _generate(bundled, engine, None, max_tokens=60)  # an unconstrained request through the same programs
    assert later.programs == 0
    gen = _generate(bundled, engine, Constraint("choice", ("yes", "no")), logprobs=20)
    first = gen.logprobs()[0]
    spelled = [bytes(a["bytes"]).decode("utf-8", "replace") for a in first["top_logprobs"]]
    assert spelled and all("yes".startswith(s) or "no".startswith(s) for s in spelled), spelled
    assert abs(sum(np.exp(a["logprob"]) for a in first["top_logprobs"]) - 1) < 1e-4  # the mass is the allowed tokens'


def test_the_kernels_step_and_the_python_callback_agree(bundled):
    """On the CPU the decode programs advance the matchers by a custom call of our kernels, with no
    Python in the step; elsewhere (a GPU, a mesh) a Python callback reaches the same functions. Both
    give the same masks, row ends and draft checks on the same tokens (random allowed tokens, and
    drafts that the grammar partly refuses)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.matchers import HostCall, Matchers

    B, K, V = 3, 3, bundled.config.sampled_ids
    kernels, callback = (Matchers(bundled.tokenizer, V, B, bundled.eos_ids) for _ in range(2))
    for m in (kernels, callback):
        m.start(0, Constraint("json_schema", SCHEMAS[5]))
        m.start(2, Constraint("choice", ("yes", "no")))  # row 1 free
    W = kernels.words
    advance = jax.jit(lambda t: HostCall(kernels).advance(jax.ShapeDtypeStruct((B, W + 1), jnp.int32), t))
    check = jax.jit(lambda d: HostCall(kernels).check(jax.ShapeDtypeStruct((B, K * W + 1), jnp.int32), d))
    assert "jaxinfer_constrain_advance" in advance.lower(jnp.zeros((B, 1), jnp.int32)).as_text()

    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(30):
        allowed = [np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V]) for row in kernels.masks]
        drafts = np.array([[*rng.choice(a, 1), *rng.integers(0, V, K - 1), rng.integers(0, K + 1)] for a in allowed])
        np.testing.assert_array_equal(np.asarray(check(drafts)), callback.check(drafts))
        tokens = np.array([[rng.choice(a)] for a in allowed])
        fed = np.asarray(advance(tokens))
        np.testing.assert_array_equal(fed, callback.advance(tokens))
        np.testing.assert_array_equal(kernels.masks, callback.masks)
        ends += fed[:, W].sum()
    assert ends >= 1 and kernels.steps == callback.steps == 30  # the choice ended; one call a step


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
def test_batch_mates_and_speculation_are_unchanged_by_constrained_rows(bundled):
    """One batch mixing constrained (greedy and sampled), free greedy and free sampled rows, every
    row drafting by prompt lookup: each row's text as the row's alone (run's engine, without
    speculation). A constrained row's drafts are checked by its matcher and verified under each
    position's mask (`matchers.Matchers.check`)."""
    schema = SCHEMAS[8]
    prompt = bundled.tokenizer.encode(
        PROMPT + '{"inner": {"a": 1, "b": true}}\nCONFIG = {"inner": {"a": 1, "b": true}}\nCONFIG = '
    )
    json_schema = Constraint("json_schema", schema)
    requests = [
        Request("json", prompt, Sampling(), 120, 1, speculate=True, constraint=json_schema),
        Request("free", prompt, Sampling(), 40, 2, speculate=True),
        Request("hot json", prompt, Sampling(temperature=0.9), 120, 3, speculate=True, constraint=json_schema),
        Request("hot", prompt, Sampling(temperature=0.9), 40, 4, speculate=True),
        Request("choice", prompt, Sampling(), 8, 5, speculate=True, constraint=Constraint("choice", ("on", "off"))),
    ]
    decoding = Decoding(speculation=Speculation(draft=4))
    mixed = {}
    Scheduler(bundled, 4, 256, decoding).run(requests, lambda r: mixed.__setitem__(r["id"], r))
    free, constrained = (Engine(bundled.config, bundled.params, 256, bundled.eos_ids) for _ in range(2))
    for r in requests:
        engine = constrained if r.constraint else free  # the free rows: programs that never constrained
        alone = Generation(bundled, engine, r.prompt_ids, r.sampling, r.max_tokens, r.seed, constraint=r.constraint)
        list(alone)
        assert mixed[r.id]["text"] == alone.text, r.id
        if r.constraint is not None:
            assert mixed[r.id]["finish_reason"] == "stop"
    speculated = {r.id: mixed[r.id]["timings"]["speculation"] for r in requests}
    print(speculated)
    assert speculated["free"]["drafted"] > 0 and speculated["json"]["accepted"] > 0
    jsonschema.validate(json.loads(mixed["json"]["text"]), schema)
    jsonschema.validate(json.loads(mixed["hot json"]["text"]), schema)


def test_bad_constraints_say_what_is_wrong():
    for bad in (
        {"guided_regex": "[a-"},
        {"guided_json": "{not json"},
        {"guided_json": {"type": "objec"}},
        {"guided_grammar": 'root ::= ("a"'},
        {"guided_grammar": "start: missing"},
        {"guided_choice": []},
        {"guided_choice": ["a", ""]},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "xml"}},
        {"guided_regex": "a", "guided_choice": ["b"]},
    ):
        with pytest.raises(JaxinferError) as e:
            from_request(bad)
        assert "\n" not in str(e.value)
    assert from_request({"response_format": {"type": "text"}}) is None
    assert from_request({"response_format": {"type": "json_object"}}) == Constraint("json_object")


def test_an_install_without_the_kernels_refuses_constraints_in_one_line(monkeypatch, bundled):
    """The matchers' step lives in the compiled kernels: where they were not built (no C++ compiler at
    install), a constraint is refused in one line before anything runs."""
    from jaxinfer import kernel, matchers

    monkeypatch.setattr(kernel, "library", lambda: None)
    matchers._libraries.cache_clear()
    try:
        with pytest.raises(JaxinferError, match="compiled kernels") as e:
            matchers.Matchers(bundled.tokenizer, bundled.config.sampled_ids, 1, bundled.eos_ids)
        assert "\n" not in str(e.value)
    finally:
        matchers._libraries.cache_clear()


@pytest.mark.slow
def test_cli_constraints_in_run_and_batch(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[5]))
    run = jaxinfer("run", PROMPT, "--json-schema", str(schema), "--json", "--no-stats")
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    jsonschema.validate(json.loads(record["text"]), SCHEMAS[5])
    assert record["finish_reason"] == "stop"
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "n = " [0-9]+')
    run = jaxinfer("run", PROMPT, "--grammar-file", str(grammar), "-n", "6", "--no-stats")
    assert run.returncode == 0 and re.fullmatch(r"n = [0-9]*", run.stdout.strip()), run.stdout
    assert jaxinfer("run", PROMPT, "--choice", "red,green", "--no-stats").stdout.strip() in ("red", "green")

    assert_one_line_error(jaxinfer_here("run", PROMPT, "--regex", "[a-"), "regex")
    assert_one_line_error(jaxinfer_here("run", PROMPT, "--regex", "a", "--choice", "b"), "--regex", "--choice")
    assert_one_line_error(jaxinfer_here("run", PROMPT, "--json-schema", str(tmp_path / "none.json")), "none.json")
    assert_one_line_error(jaxinfer_here("run", PROMPT, "--json-schema", '{"type": "objec"}'), "objec")

    lines = [
        {"id": "schema", "prompt": PROMPT, "max_tokens": 120, "guided_json": SCHEMAS[2]},
        {"id": "free", "prompt": PROMPT, "max_tokens": 8},
        {"id": "bad", "prompt": PROMPT, "guided_regex": "(("},
        {
            "custom_id": "openai",
            "url": "/v1/completions",
            "body": {
                "prompt": PROMPT,
                "max_tokens": 120,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}},
            },
        },
        {
            "custom_id": "cut",
            "url": "/v1/completions",
            "body": {
                "prompt": PROMPT,
                "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}},
            },
        },
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = jaxinfer("batch", str(source), "-b", "3")
    records = {r.get("custom_id", r["id"]): r for r in map(json.loads, done.stdout.splitlines())}
    jsonschema.validate(json.loads(records["schema"]["text"]), SCHEMAS[2])
    assert "regex" in records["bad"]["error"] and done.returncode == 1
    choice = records["openai"]["response"]["body"]["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), SCHEMAS[1])
    assert records["cut"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert records["cut"]["response"]["body"]["jaxinfer"]["finish_reason"] == "unfinished"
