"""Byte tokenizer: lossless round trip, and a streaming decoder that never splits a character."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from model import ByteTokenizer

tok = ByteTokenizer()


@given(st.text())
def test_round_trip(text):
    assert tok.decode(tok.encode(text)) == text


@given(st.text(), st.lists(st.integers(0, 40), max_size=8))
def test_stream_decoder_never_emits_partial_characters(text, cuts):
    ids = [tok.bos_id, *tok.encode(text)]
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    for piece in pieces:
        assert "\ufffd" not in piece or "\ufffd" in text
    assert "".join(pieces) == text


def test_multibyte_character_split_across_calls():
    ids = tok.encode("é🙂")
    assert len(ids) == 6
    dec = tok.stream_decoder()
    assert dec.feed(ids[0]) == ""
    assert dec.feed(ids[1]) == "é"
    assert [dec.feed(i) for i in ids[2:]] == ["", "", "", "🙂"]


def test_specials_have_no_text():
    assert tok.decode([tok.bos_id, 72, 105, tok.eos_id]) == "Hi"
    assert tok.token_text(tok.eos_id) == "<eos>"
    assert tok.vocab_size == 258
