"""Constrained decoding: grammars compiled for a tokenizer, and the token mask they put on
each row of a batch (llguidance).

A `Grammar` is what a request asks its output to be, in llguidance's grammar format: a JSON
schema (`Grammar.json_schema`, OpenAI's `json_schema` response format), any JSON object
(`json_object`), or a Lark grammar (`Grammar.lark`: tool calls in a model's own format,
model/tool_calls.py). `Grammars` holds one tokenizer's llguidance view (built once, on first
use: ~0.4 s for SmolLM2's 49k tokens) and compiles a grammar into a `Matcher`, the parser
state of one generation; `Matcher.fork` copies it for another choice.

Each decode step, `fill` asks every constrained row's matcher which tokens may come next
(llguidance's executor, in parallel threads that drop the GIL) into one packed bitmask,
`mask_logits` sets the others' logits to -inf on the rows that have a matcher, and, once
sampled, `advance` hands each matcher its row's token. Unconstrained rows pay nothing. When
a grammar is complete, its mask holds only EOS: the row ends as any row at EOS does.

llguidance rather than xgrammar (docs/MODEL_CARD.md): one self-contained wheel (Rust, abi3)
with no dependency, where xgrammar pulls in transformers and triton beside our torch;
masks are computed lazily per step (no per-schema precompilation to wait for, so a new
schema costs ~1 ms to compile), and it parses JSON schemas, Lark and GBNF alike.

This module knows nothing of requests, HTTP or Redis.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

# JSON as a model writes it best: no free whitespace (it would let a row pad forever)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or JSON schema) that does not compile, or a tokenizer that cannot be constrained."""


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's format (`text`), and what it is, for messages."""

    text: str
    what: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any], *, strict: bool = True) -> Grammar:
        """Output that is JSON valid against `schema`. Not `strict`, keywords llguidance does
        not implement are ignored rather than refused."""
        options = {**JSON_OPTIONS, "lenient": not strict}
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=options)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid: {exc}") from None
        return cls(text, "the JSON schema")

    @classmethod
    def json_object(cls) -> Grammar:
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, source: str, what: str = "the grammar") -> Grammar:
        return cls(llguidance.LLMatcher.grammar_from_lark(source), what)


class Matcher:
    """One generation's parser state under a grammar: which tokens may come next."""

    def __init__(self, inner: llguidance.LLMatcher):
        self._inner = inner

    def fork(self) -> Matcher:
        """An independent copy, at the same point (another choice of the same request)."""
        return Matcher(self._inner.deep_copy())

    def consume(self, token: int) -> bool:
        """The row sampled `token`; False if the grammar did not allow it (never, masked)."""
        return bool(self._inner.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (its mask holds only EOS)."""
        return bool(self._inner.is_stopped())

    @property
    def error(self) -> str:
        return str(self._inner.get_error()) if self._inner.is_error() else ""


class Grammars:
    """The grammars of one tokenizer: compiles them into matchers. Thread-safe; its
    llguidance tokenizer is built on first use, off whichever thread asks first."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def supported(self) -> bool:
        return isinstance(self.tokenizer, (BPETokenizer, ByteTokenizer))

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer)
            return self._ll

    def matcher(self, grammar: Grammar) -> Matcher:
        """`grammar` compiled for this tokenizer (~1 ms for a small schema; it drops the
        GIL). Raises GrammarError for a grammar that does not compile."""
        ll = self._tokenizer()
        problem = llguidance.LLMatcher.validate_grammar(grammar.text, ll)
        if problem:
            raise GrammarError(f"{grammar.what} cannot be enforced: {problem}")
        inner = llguidance.LLMatcher(ll, grammar.text, log_level=0)
        if inner.is_error():
            raise GrammarError(f"{grammar.what} cannot be enforced: {inner.get_error()}")
        return Matcher(inner)


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, BPETokenizer):
        return llguidance.LLTokenizer(
            json.dumps(tokenizer.spec()["tokenizer"]),
            n_vocab=tokenizer.vocab_size,
            eos_token=tokenizer.eos_id,
        )
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Bytes(tokenizer)), n_vocab=tokenizer.vocab_size
        )
    raise GrammarError(f"a {getattr(tokenizer, 'kind', '?')} tokenizer cannot be constrained by a grammar")


class _Bytes:
    """A UTF-8 byte tokenizer as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tok: ByteTokenizer):
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"]
        self.special_token_ids = [tok.bos_id, tok.eos_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


# -- the batch's mask --------------------------------------------------------------------------
_executor: llguidance.LLExecutor | None = None


def fill(matchers: Sequence[Matcher], vocab_size: int) -> torch.Tensor:
    """The packed bitmask [len(matchers), ceil(V / 32)] int32 of the tokens each matcher
    allows next, computed in parallel (llguidance's executor: threads without the GIL)."""
    global _executor
    # (imported at the first mask: llguidance.torch imports torch's compiler, seconds that
    # every server start and every `import model` would pay for a grammar it may never use)
    import llguidance.torch as llg_torch

    if _executor is None:
        _executor = llguidance.LLExecutor()
    bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    llg_torch.fill_next_token_bitmask_par(_executor, [(m._inner, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with -inf wherever the packed `bitmask` (one row per entry of
    `rows`, the batch rows it constrains) does not allow a token."""
    B, V = logits.shape
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().reshape(len(rows), -1)[:, :V]  # (R, V)
    keep = torch.ones(B, V, dtype=torch.bool)
    keep[list(rows)] = allowed
    return logits.masked_fill(~keep.to(logits.device, non_blocking=True), float("-inf"))
