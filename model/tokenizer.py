"""Tokenizers: text <-> token ids, plus an incremental decoder for streaming.

The streaming decoder is the piece the server relies on: fed one id at a time it emits
text only once a character is complete, so the concatenation of everything it emits
equals `decode(all_ids)` exactly, multi-byte UTF-8 included.

Tokenizers are described by a small JSON spec stored in each checkpoint
(`tokenizer.json`); `from_spec` is the only constructor the loader uses. Three kinds: UTF-8
bytes (the native models), word-level vocabularies (pretrained WikiText-103 models), and
subword tokenizers run by Hugging Face's `tokenizers` library (pretrained LLMs and converted
HF Mamba checkpoints: the spec holds the library's own tokenizer JSON, `BPETokenizer`).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol


class StreamDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def stream_decoder(self) -> StreamDecoder: ...
    def token_text(self, token_id: int) -> str: ...
    def spec(self) -> dict: ...


class _ByteStreamDecoder:
    def __init__(self, tok: ByteTokenizer):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id < 256:
            return self._utf8.decode(bytes([token_id]))
        return ""  # special tokens have no text

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; specials follow: <bos>=256, <eos>=257."""

    kind = "byte"

    def __init__(self) -> None:
        self.bos_id: int | None = 256
        self.eos_id: int | None = 257
        self.vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder(self)

    def token_text(self, token_id: int) -> str:
        """Text of one id on its own (a lone continuation byte shows as U+FFFD)."""
        if token_id == self.bos_id:
            return "<bos>"
        if token_id == self.eos_id:
            return "<eos>"
        return bytes([token_id]).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"kind": self.kind}


class _WordStreamDecoder:
    """Word ids carry whole symbols: each id's text is final the moment it arrives."""

    def __init__(self, tok: WordTokenizer):
        self._tok = tok

    def feed(self, token_id: int) -> str:
        return self._tok.token_text(token_id)

    def flush(self) -> str:
        return ""


class WordTokenizer:
    """A word-level vocabulary, tokenised the way the WikiText-103 preprocessing did.

    As the original Transformer-XL `corpus` code with `add_eos`: each line is stripped and
    split on whitespace, and every line break becomes `<eos>` (every line of a corpus file
    ends with one). A symbol outside the vocabulary becomes `<unk>`. There is no BOS.

    Text out: each word is written with one leading space and `<eos>` as a newline, so
    decode(ids) == "".join(token_text(i) for i in ids), the stream decoder needs no
    lookahead, generated text appends to a prompt with the space it needs, and
    encode(decode(ids)) == ids.

    The vocabulary is plain text, one symbol per line in id order (a line's first
    whitespace-separated field, so "symbol count" files read too). Nothing is unpickled.
    """

    kind = "word"
    EOS = "<eos>"
    UNK = "<unk>"

    def __init__(self, symbols: list[str]):
        seen: set[str] = set()
        for s in symbols:
            if s in seen:
                raise ValueError(f"word vocabulary lists {s!r} twice")
            seen.add(s)
        bad = next((s for s in symbols if not s or s != "".join(s.split())), None)
        if bad is not None:
            raise ValueError(f"word vocabulary symbol {bad!r} is empty or holds whitespace")
        for special in (self.EOS, self.UNK):  # with <unk>, any text encodes
            if special not in symbols:
                raise ValueError(f"word vocabulary has no {special} symbol")
        self.symbols = list(symbols)
        self.sym2idx = {s: i for i, s in enumerate(self.symbols)}
        self.vocab_size = len(self.symbols)
        self.bos_id: int | None = None
        self.eos_id: int | None = self.sym2idx[self.EOS]
        self.unk_id = self.sym2idx[self.UNK]

    @classmethod
    def from_vocab_file(cls, path: str | Path) -> WordTokenizer:
        symbols = []
        with open(path, encoding="utf-8") as f:  # universal newlines, as the original read it
            for n, line in enumerate(f, 1):
                fields = line.split()
                if not fields:
                    raise ValueError(f"{path}:{n}: empty line in a vocabulary (one symbol per line)")
                symbols.append(fields[0])
        return cls(symbols)

    def encode(self, text: str) -> list[int]:
        lines = text.split("\n")
        ids: list[int] = []
        for i, line in enumerate(lines):
            ids.extend(self.sym2idx.get(sym, self.unk_id) for sym in line.split())
            if i < len(lines) - 1:
                ids.append(self.sym2idx[self.EOS])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.token_text(i) for i in ids)

    def stream_decoder(self) -> StreamDecoder:
        return _WordStreamDecoder(self)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if token_id == self.eos_id:
            return "\n"
        return " " + self.symbols[token_id]

    def spec(self) -> dict:
        return {"kind": self.kind, "symbols": self.symbols}


class _IncrementalDecoder:
    """Text out as ids come in, for a tokenizer whose decoding is not per token: a token may
    hold part of a character (byte-level BPE), so the text of the ids since the last complete
    character is decoded again with each new id, and released once it no longer ends in a
    partial one (U+FFFD). What is released adds up to `decode(all ids)` (vLLM's scheme)."""

    def __init__(self, tok: BPETokenizer):
        self._tok = tok
        self._ids: list[int] = []
        self._start = 0  # the ids decoded and released so far begin here ...
        self._end = 0  # ... and end here

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._start : self._end])
        text = self._tok.decode(self._ids[self._start :])
        if not final and (len(text) <= len(done) or text.endswith("\ufffd")):
            return ""
        self._start, self._end = self._end, len(self._ids)
        return text[len(done) :]


class BPETokenizer:
    """A subword tokenizer (byte-level BPE, say) that Hugging Face's `tokenizers` library
    runs from its JSON description (a `tokenizer.json`), with the model's BOS (None when a
    stream does not start with one) and EOS ids. Special tokens in a text (e.g. `<|im_end|>`)
    encode as their ids and decode as their text, so a transcript encodes back to its ids."""

    kind = "bpe"

    def __init__(self, tokenizer_json: str, vocab_size: int, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer

        self._json = tokenizer_json
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.vocab_size = max(vocab_size, self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return _IncrementalDecoder(self)

    def token_text(self, token_id: int) -> str:
        """Text of one id on its own (part of a character shows as U+FFFD)."""
        return self.decode([token_id])

    def spec(self) -> dict:
        return {
            "kind": self.kind,
            "tokenizer": json.loads(self._json),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }


def from_spec(spec: dict, directory: str | None = None) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "word":
        symbols = spec.get("symbols")
        if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
            raise ValueError("a word tokenizer spec needs 'symbols': a list of strings")
        return WordTokenizer(symbols)
    if kind == "bpe":
        ids = [spec.get(k) for k in ("vocab_size", "bos_id", "eos_id")]
        if not isinstance(spec.get("tokenizer"), dict) or not all(
            i is None or isinstance(i, int) for i in ids
        ):
            raise ValueError("a bpe tokenizer spec needs 'tokenizer' (an object) and integer ids")
        return BPETokenizer(json.dumps(spec["tokenizer"]), spec.get("vocab_size") or 0, ids[1], ids[2])
    raise ValueError(f"unknown tokenizer kind {kind!r}")
