"""Incremental detokenization against the tokenizer's own decode of the whole output: the
streamed pieces join to the same text, and no piece ends inside a multi-byte character."""

import random

import pytest
from transformers import AutoTokenizer

from echo.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamingDetokenizer,
    make_detokenizer,
)
from echo.models.default_model import ensure_default_model

TEXT = "Héllo wörld, 你好世界! Ünïcödé 😀🎉 naïve café — done.\n  indented\tτέλος"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.mark.parametrize("kind", [StreamingDetokenizer, IncrementalDetokenizer])
def test_streamed_pieces_join_to_the_whole_decode(tokenizer, kind):
    prompt = tokenizer.encode("Say it:")
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(5):  # tokens arriving one at a time, or a few per step
        detok = kind(tokenizer, prompt)
        pieces, i = [], 0
        while i < len(output):
            n = rng.randint(1, 3)
            pieces.append(detok.add_tokens(output[i:i + n]))
            i += n
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(output)
        assert not any("\ufffd" in p for p in pieces)  # no broken character was ever sent


def test_a_trailing_partial_character_is_flushed_as_a_replacement(tokenizer):
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1  # byte-level BPE splits it, so its first token is a fragment
    for kind in (StreamingDetokenizer, IncrementalDetokenizer):
        detok = kind(tokenizer, [1])
        assert detok.add_tokens(emoji[:1]) == ""
        assert detok.flush() == tokenizer.decode(emoji[:1])  # what decode gives: U+FFFD


def test_special_tokens_are_skipped_and_a_fast_tokenizer_streams(tokenizer):
    assert isinstance(make_detokenizer(tokenizer, [1]), StreamingDetokenizer)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(" plain", add_special_tokens=False) + [eos]
    for skip in (True, False):
        detok = make_detokenizer(tokenizer, [1], skip_special_tokens=skip)
        text = detok.add_tokens(ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
