"""The grammars echo builds from StructuredOutputsParams, checked with xgrammar's own matcher
against hand-written valid and invalid texts."""

import pytest
import xgrammar

from echo import StructuredOutputsParams
from echo.structured_output.grammar_spec import build_grammar


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    from echo.models.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return tokenizer, xgrammar.GrammarCompiler(info)


def accepts(compiler, params: StructuredOutputsParams, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler[1].compile_grammar(build_grammar(params)))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("string_schema", [{"type": "string"},
                                           {"type": "string", "maxLength": 12},
                                           {"type": "string", "minLength": 1}])
def test_json_strings_refuse_control_characters(compiler, string_schema):
    """xgrammar 0.2.9 let control characters into strings with a length bound; echo patches
    the grammar (a random model sampled the byte 0x10 inside a maxLength string)."""
    params = StructuredOutputsParams(json={"type": "object", "properties": {"n": string_schema},
                                           "required": ["n"]})
    assert accepts(compiler, params, '{"n": "ok fine"}')
    for bad in ("\x10", "\x00", "\x1f", "\t", "\n"):
        assert not accepts(compiler, params, '{"n": "a' + bad + 'b"}'), repr(bad)
    tokenizer, xgr_compiler = compiler
    matcher = xgrammar.GrammarMatcher(xgr_compiler.compile_grammar(build_grammar(params)))
    assert matcher.accept_string('{"n": "a')
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("Đ"))  # byte 0x10


def test_choice_escapes_quotes_and_keeps_unicode(compiler):
    params = StructuredOutputsParams(choice=['say "hi"', "café\n", "a\\b"])
    for text in ('say "hi"', "café\n", "a\\b"):
        assert accepts(compiler, params, text)
    assert not accepts(compiler, params, "say hi")


def test_regex_and_grammar_match_whole_texts(compiler):
    regex = StructuredOutputsParams(regex=r"\d{3}-[a-z]+")
    assert accepts(compiler, regex, "123-abc") and not accepts(compiler, regex, "12-abc")
    ebnf = StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"')
    assert accepts(compiler, ebnf, "(42)") and not accepts(compiler, ebnf, "(42")
