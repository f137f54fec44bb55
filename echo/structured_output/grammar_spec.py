"""A request's StructuredOutputsParams as an xgrammar Grammar, checked before anything queues.

The frontend builds the Grammar once to refuse a bad schema, regex or grammar with the
compiler's own message (HTTP 400 naming the field); the engine builds it again on a compile
thread, where the tokenizer-specific compilation, the costly part, follows.
"""

import json
import re

import xgrammar

from echo.sampling_params import StructuredOutputsParams

# the largest constraint text a request may send; a schema this size compiles in well under
# a second, and bigger ones are where compile time and memory start to grow out of bounds
MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICES = 1024
# whitespace characters in a row a JSON constraint lets a model write while it allows anything
# else (structured_output/whitespace.py): room for pretty-printing at any depth a model uses,
# but a bound: unbounded, a model at temperature 1 can fill max_tokens with blank lines and
# never close the object. Enforced on the mask, not in the grammar: xgrammar's counted
# whitespace (max_whitespace_cnt) made every fill 2-5x dearer (tools/dev/probe_grammar_step.py)
MAX_JSON_WHITESPACE = 32
# JSON schema nesting: xgrammar's grammar grows about with the cube of the depth (1 MB of
# grammar at 200 levels, a hang at 2,000); real schemas nest a handful of levels
MAX_SCHEMA_DEPTH = 64
# xgrammar prefixes its messages with a time and its source file: "[12:00:00] /x/y.cc:94: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def constraint_size(params: StructuredOutputsParams) -> int:
    """Characters of the constraint's text (a choice list counts all of its strings)."""
    value = getattr(params, params.kind)
    if params.kind == "choice":
        return sum(len(c) for c in value)
    return len(value) if isinstance(value, str) else 0


def build_grammar(params: StructuredOutputsParams, field: str | None = None) -> xgrammar.Grammar:
    """The Grammar for params; ValueError naming the field (structured_outputs.KIND unless
    the caller names where the constraint came from), with xgrammar's message."""
    kind = params.kind
    field = field or f"structured_outputs.{kind}"
    size = constraint_size(params)
    if size > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{field}: {size} characters is more than the {MAX_GRAMMAR_CHARS} "
                         "allowed")
    if kind == "choice" and len(params.choice) > MAX_CHOICES:
        raise ValueError(f"{field}: {len(params.choice)} choices is more than the "
                         f"{MAX_CHOICES} allowed")
    try:
        return _grammar(params, kind)
    except KeyError as e:  # a structural tag without one of its keys
        raise ValueError(f"{field}: missing {e}") from None
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for bad input
        raise ValueError(f"{field}: {_first_line(e)}") from None


def _grammar(params: StructuredOutputsParams, kind: str) -> xgrammar.Grammar:
    any_whitespace = not params.disable_any_whitespace
    if kind == "json":
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object or a boolean, got {params.json[:40]}")
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"nested deeper than the {MAX_SCHEMA_DEPTH} levels allowed")
        return _json_grammar(params.json, any_whitespace)
    if kind == "json_object":
        return _json_grammar('{"type": "object"}', any_whitespace)
    if kind == "regex":
        return xgrammar.Grammar.from_regex(params.regex)
    if kind == "choice":
        # JSON's string escapes are the EBNF literal's: quotes, backslashes, \uXXXX
        alternatives = " | ".join(json.dumps(c) for c in params.choice)
        return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
    if kind == "grammar":
        return xgrammar.Grammar.from_ebnf(params.grammar)
    tag = json.loads(params.structural_tag)
    if isinstance(tag, dict) and "structures" in tag:  # vLLM's first format: begin/schema/end
        items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                            end=s["end"]) for s in tag["structures"]]
        return xgrammar.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgrammar.Grammar.from_structural_tag(params.structural_tag)


def _depth(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else (
            value if isinstance(value, list) else ())
        if children:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


# xgrammar 0.2.9 writes a string with maxLength/minLength as repeats of this class, which
# lets control characters through (JSON forbids them unescaped: a random model emitted \x10);
# the class its plain strings use excludes them. Patched in the grammar's text, re-parsed.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\"\\\\\\0-\\x1f]'


def limits_whitespace(params: StructuredOutputsParams) -> bool:
    """Whether the request's grammar is JSON with free whitespace, which the mask bounds."""
    return params.kind in ("json", "json_object") and not params.disable_any_whitespace


def _json_grammar(schema: str, any_whitespace: bool) -> xgrammar.Grammar:
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _first_line(error: Exception) -> str:
    """xgrammar's messages can run to a dump of the grammar: its first lines say what broke."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = _LOG_PREFIX.sub("", " ".join(line.strip() for line in lines[:3]))
    return text if len(text) <= 500 else text[:497] + "..."
