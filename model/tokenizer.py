"""Tokenizers: text <-> token ids, plus an incremental decoder for streaming.

The streaming decoder is the piece the server relies on: fed one id at a time it emits
text only once a character is complete, so the concatenation of everything it emits
equals `decode(all_ids)` exactly, multi-byte UTF-8 included.

Tokenizers are described by a small JSON spec stored in each checkpoint
(`tokenizer.json`); `from_spec` is the only constructor the loader uses.
"""

from __future__ import annotations

import codecs
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


def from_spec(spec: dict, directory: str | None = None) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r}")
