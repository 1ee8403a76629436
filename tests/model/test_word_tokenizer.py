"""Word-level tokenizer: WikiText-103 tokenisation, plain-text vocabularies, streaming text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model.tokenizer import WordTokenizer, from_spec

SYMBOLS = ["<eos>", "the", "<unk>", ",", "@-@", "game", "=", "Valkyria", "Chronicles", "III", "."]
tok = WordTokenizer(SYMBOLS)
EOS, UNK = 0, 2


def test_lines_are_split_on_whitespace_and_end_in_eos():
    # two lines of the WikiText-103 training file, exactly as stored (leading and trailing spaces)
    text = " = Valkyria Chronicles III = \n the game , the  game . \n"
    assert tok.encode(text) == [6, 7, 8, 9, 6, EOS, 1, 5, 3, 1, 5, 10, EOS]


def test_blank_lines_are_a_lone_eos_and_a_last_line_without_newline_has_none():
    assert tok.encode(" \n \n the") == [EOS, EOS, 1]
    assert tok.encode("") == []
    assert tok.encode("the\r\ngame") == [1, EOS, 5]  # a CR is whitespace, as line.strip() made it


def test_unknown_symbols_become_unk():
    assert tok.encode("the Valkyrie game") == [1, UNK, 5]
    assert tok.unk_id == UNK


def test_decode_writes_words_with_one_leading_space_and_eos_as_newline():
    ids = [6, 7, 8, 9, 6, EOS, 1, 5]
    assert tok.decode(ids) == " = Valkyria Chronicles III =\n the game"
    assert tok.token_text(EOS) == "\n" and tok.token_text(1) == " the"
    assert tok.bos_id is None and tok.eos_id == EOS and tok.vocab_size == len(SYMBOLS)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_text(len(SYMBOLS))


ids_strategy = st.lists(st.integers(0, len(SYMBOLS) - 1), max_size=60)


@given(ids_strategy)
def test_round_trip_through_text(ids):
    assert tok.encode(tok.decode(ids)) == ids


@given(ids_strategy, st.integers(0, 60))
def test_stream_decoder_pieces_add_up_to_decode(ids, cut):
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids)
    # text generated after a prompt appends to it with the space it needs
    prompt, generated = ids[:cut], ids[cut:]
    assert tok.decode(prompt) + "".join(tok.stream_decoder().feed(i) for i in generated) == tok.decode(ids)


def test_vocab_file_is_plain_text_in_id_order(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("<eos>\nthe 1061396\n<unk>\n", encoding="utf-8")  # an optional count column is ignored
    t = WordTokenizer.from_vocab_file(path)
    assert t.symbols == ["<eos>", "the", "<unk>"] and t.unk_id == 2
    path.write_text("<eos>\n\nthe\n")
    with pytest.raises(ValueError, match=r"vocab.txt:2: empty line"):
        WordTokenizer.from_vocab_file(path)


@pytest.mark.parametrize(
    ("symbols", "message"),
    [
        (["the", "<unk>"], "no <eos>"),
        (["<eos>", "the"], "no <unk>"),
        (["<eos>", "<unk>", "the", "the"], "'the' twice"),
        (["<eos>", "<unk>", "a b"], "whitespace"),
    ],
)
def test_bad_vocabularies_are_refused(symbols, message):
    with pytest.raises(ValueError, match=message):
        WordTokenizer(symbols)


def test_spec_round_trip():
    again = from_spec(tok.spec())
    assert isinstance(again, WordTokenizer) and again.symbols == SYMBOLS
    with pytest.raises(ValueError, match="'symbols'"):
        from_spec({"kind": "word", "symbols": "<eos>"})
