"""Tokenizers: text <-> token ids, plus an incremental decoder for streaming.

The streaming decoder is the piece the server relies on: fed one id at a time it emits
text only once a character is complete, so the concatenation of everything it emits
equals `decode(all_ids)` exactly, multi-byte UTF-8 included.

Tokenizers are described by a small JSON spec stored in each checkpoint
(`tokenizer.json`); `from_spec` is the only constructor the loader uses. Three kinds: UTF-8
bytes (the native models), word-level vocabularies (pretrained WikiText-103 models), and an
HF `tokenizer.json` (converted HF checkpoints, e.g. Mamba's), run by the `tokenizers` library.
"""

from __future__ import annotations

import codecs
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


class _HFStreamDecoder:
    """The `tokenizers` library's own incremental decoder: text once it is complete."""

    def __init__(self, tok: HFTokenizer):
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def feed(self, token_id: int) -> str:
        if not 0 <= token_id < self._tok.known:
            return ""  # an id past the tokenizer's (a padded embedding's) has no text
        return self._stream.step(self._tok.inner, token_id) or ""

    def flush(self) -> str:
        return ""


class HFTokenizer:
    """An HF `tokenizer.json` (BPE, WordPiece, Unigram or word-level), run by `tokenizers`.

    The spec holds the tokenizer.json itself, so a converted checkpoint is self-contained;
    `vocab_size` is the model's, which may exceed the tokenizer's (padded embeddings: ids
    past the tokenizer's decode to nothing). Text in gets no special tokens (the server adds
    BOS itself); text out skips them, as the stream decoder does.
    """

    kind = "hf"

    def __init__(self, tokenizer_json: dict, vocab_size: int, bos_id: int | None, eos_id: int | None):
        import json

        from tokenizers import Tokenizer as Inner

        self.tokenizer_json = tokenizer_json
        self.inner = Inner.from_str(json.dumps(tokenizer_json))
        self.known = self.inner.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(vocab_size, self.known)
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.inner.decode([i for i in ids if 0 <= i < self.known], skip_special_tokens=True))

    def stream_decoder(self) -> StreamDecoder:
        return _HFStreamDecoder(self)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return str(self.inner.decode([token_id], skip_special_tokens=False)) if token_id < self.known else ""

    def spec(self) -> dict:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer_json,
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
    if kind == "hf":
        if not isinstance(spec.get("tokenizer"), dict) or not isinstance(spec.get("vocab_size"), int):
            raise ValueError("an hf tokenizer spec needs 'tokenizer' (a tokenizer.json object) and 'vocab_size'")
        return HFTokenizer(spec["tokenizer"], spec["vocab_size"], spec.get("bos_id"), spec.get("eos_id"))
    raise ValueError(f"unknown tokenizer kind {kind!r}")
