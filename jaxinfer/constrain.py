"""Constrained decoding: output that matches a JSON schema, any JSON object, a regular expression,
one of a few choices, or a grammar (Lark, or llama.cpp's GBNF), valid by construction.

The grammar-to-token-mask work is llguidance's (Microsoft's, what llama.cpp's `--grammar` build
option, vLLM and SGLang use): an Earley parser over the grammar's lexemes that, given the tokens so
far, gives the set of tokens that can extend them to a valid string: 4–10 µs a step over the
bundled model's 4,096 tokens (median; 23 µs at the 90th percentile of a JSON schema's steps; a
Zen 4), ~170 µs over 49,152 (docs/structured.md).

The matchers that apply a constraint inside the decode loop, and how each step's mask reaches the
device, are `jaxinfer.matchers`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jaxinfer.errors import JaxinferError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # a request's
# Compact JSON: llguidance's flexible whitespace lets a small model pad with newlines and spaces
# until the budget runs out (the bundled model, which learned Python, did); one space after ":" and ",".
JSON_OPTIONS = {"whitespace_flexible": False}


_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "items")  # lists of schemas ("items": draft 7's tuples)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema, composed: bool = False):
    """`schema` with its objects closed where they do not say: an object schema that names its
    `properties` (or their `patternProperties`) and says nothing of others gets
    `"additionalProperties": false`, as OpenAI's strict
    mode and xgrammar (vLLM's default) read it. JSON Schema's own default admits any other key, and a
    small model given it adds keys until its budget runs out (4 of 15 outputs of a two-property
    schema, -n 200). A schema that wants other keys says `"additionalProperties": true` (or a schema
    for them). Not closed: members of an `allOf` (each would refuse the others' properties), and
    objects composed with `allOf`/`anyOf`/`oneOf`/`$ref` beside their properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            out[key] = closed(schema[key])
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), list):
            out[key] = [closed(s) for s in schema[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [closed(s, composed=True) for s in schema["allOf"]]
    open_ended = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
    named = "properties" in schema or "patternProperties" in schema
    if named and not composed and not any(key in schema for key in open_ended):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: `kind` one of KINDS; `value` a JSON schema (a dict, or its
    text), a regular expression, the choices (a tuple of strings), a grammar's text (Lark or GBNF),
    or None for `json_object`."""

    kind: str
    value: object = None

    def grammar(self) -> str:
        """The llguidance grammar (checked by `check`, not here)."""
        import llguidance

        match self.kind:
            case "json_schema":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                return llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_OPTIONS)
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            case "choice":
                return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, self.value)))
            case "grammar":  # llama.cpp's GBNF (`root ::= ...`) through llguidance's converter, else Lark
                from llguidance.gbnf_to_lark import any_to_lark

                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.value))
        raise ValueError(self.kind)

    def check(self) -> None:
        """Refuse a constraint that cannot be compiled (before any weights are read)."""
        checked_grammar(self)


def checked_grammar(constraint: Constraint) -> str:
    """The constraint's llguidance grammar, checked without a tokenizer: one line where it cannot be read
    or compiled."""
    import llguidance
    from llguidance.gbnf_to_lark import GbnfToLarkError

    what = constraint.kind.replace("_", " ")
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError, GbnfToLarkError) as e:  # not JSON; a GBNF grammar the converter refuses
        raise JaxinferError(f"the {what} cannot be read: {first_line(e)}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise JaxinferError(
            f"the {what} cannot be compiled: {first_line(error)}"
        )  # (not named: its words are llguidance's)
    return grammar


def first_line(message) -> str:
    """llguidance's message in one line: its first, and the parser's own "error: ..." where it gives one."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    said = [line for line in lines[1:] if line.startswith("error:")][:1]
    return " ".join([lines[0].rstrip(":;"), *(s.removeprefix("error:").strip() for s in said)])[:300]


def from_flags(
    json_schema: str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> Constraint | None:
    """At most one constraint from the values given (a schema's text or a grammar's: already read
    from their files by the caller); None when none is."""
    given = [
        Constraint(kind, value)
        for kind, value, on in (
            ("json_schema", json_schema, json_schema is not None),
            ("json_object", None, json_object),
            ("regex", regex, regex is not None),
            ("choice", tuple(choice or ()), bool(choice)),
            ("grammar", grammar, grammar is not None),
        )
        if on
    ]
    if len(given) > 1:
        raise JaxinferError(
            "give one constraint at most: " + ", ".join(c.kind for c in given), *(c.kind for c in given)
        )
    if given and given[0].kind == "choice" and not all(given[0].value):
        raise JaxinferError("each choice must be non-empty text", "choice")
    if given:
        given[0].check()
    return given[0] if given else None


def from_request(item: dict) -> Constraint | None:
    """The constraint of a request's fields: OpenAI's `response_format` ({"type": "text" |
    "json_object" | "json_schema", "json_schema": {"schema": ...}}) or vLLM's `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar`."""
    found = []
    response_format = item.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise JaxinferError('"response_format" must be {"type": "text" | "json_object" | "json_schema", ...}')
        kind = response_format["type"]
        if kind == "json_object":
            found.append(Constraint("json_object"))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise JaxinferError('"response_format": json_schema needs {"json_schema": {"name", "schema": {...}}}')
            found.append(Constraint("json_schema", inner["schema"]))
    for field, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if field not in item:
            continue
        value = item[field]
        ok = {
            "json_schema": isinstance(value, (dict, str)),
            "regex": isinstance(value, str),
            "choice": isinstance(value, list) and value and all(isinstance(v, str) and v for v in value),
            "grammar": isinstance(value, str),
        }[kind]
        if not ok:
            rule = {
                "json_schema": "a JSON schema",
                "regex": "a string",
                "choice": "a list of non-empty strings",
                "grammar": "a string",
            }
            raise JaxinferError(f'"{field}" must be {rule[kind]}')
        found.append(Constraint(kind, tuple(value) if kind == "choice" else value))
    if len(found) > 1:
        raise JaxinferError("a request takes one constraint at most (response_format or one guided_* field)")
    if found:
        found[0].check()
    return found[0] if found else None


def check_one_process() -> None:
    """Refuse constraints where processes are joined in one mesh (`--coordinator`): the matchers
    live in one process, and the others' programs would wait on calls they cannot make."""
    import jax

    if jax.process_count() > 1:
        raise JaxinferError(
            "constrained output runs in one process: drop the coordinator (or the constraint)", "coordinator"
        )


def mask_words(vocab: int) -> int:
    """int32 words of a row's token mask: a bit per id sampled from."""
    return (vocab + 31) // 32
