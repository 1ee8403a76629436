"""The runner: executes what the scheduler chose, one step at a time, on the engine thread.

It loads a request's starting state, consumes prompt chunks (`LanguageModel.prefill`,
the same step `LanguageModel.consume` takes), and runs the decode step: one forward pass
for every decoding row together, sampling with per-row parameters, detokenising and
stop matching, in the style of gpt-fast's `decode_one_token`. A finished row's state is
split out of the batch and encoded as its request asks (`model.state.encode`).

The rows' states are kept stacked between decode steps (`lm.stack_states`) and split
(`lm.split_state`) only when the batch's membership changes. Batching changes no
result: each row's logits depend only on its own state.

The runner decides nothing (that is the scheduler's job) and never blocks on the event
loop; it imports only `model/` and the engine's own modules.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model import LanguageModel, State, StateError
from model.sampling import make_generator, sample
from model.state import STORAGE_DTYPES, encode
from model.tokenizer import StreamDecoder, Tokenizer

from .requests import EmptyContext, Finished, FinishReason, Outbox, Request, Stored, TokenEvent

Step = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """An admitted request and its progress through the prompt and the decoding."""

    req: Request
    state: State
    loaded: State | None  # the starting state, when it was loaded from bytes
    generator: torch.Generator
    decoder: StreamDecoder
    pending: list[int]  # prompt tokens not yet consumed
    prompt_logprobs: list[float | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None

    @property
    def decoding(self) -> bool:
        """Its prompt is consumed and it still samples tokens."""
        return not self.pending and self.finish_reason is None and self.req.max_tokens > 0


@dataclass
class Counters:
    """What the runner has done, for the metrics (read from other threads, never reset)."""

    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    max_batch: int = 0
    load_seconds: float = 0.0  # turning stored bytes into states
    encode_seconds: float = 0.0  # turning states into commit bytes


class Runner:
    def __init__(self, lm: LanguageModel, tokenizer: Tokenizer, decode: Step, outbox: Outbox):
        self.lm = lm
        self.outbox = outbox
        self.tokenizer = tokenizer
        self._decode = decode  # the one-token forward (possibly compiled)
        self._batch: State | None = None  # stacked states of _members, row i = _members[i]
        self._members: list[Row] = []
        self.counters = Counters()

    # -- admission ---------------------------------------------------------------------------
    def load(self, req: Request) -> Row:
        """The request's starting state, ready to run. Raises StateError or EmptyContext."""
        loaded = None
        if req.start is None:
            state = self.lm.new_state(1)
        elif isinstance(req.start, Stored):
            state = loaded = self._load(req.start)
        else:
            state = req.start
        if not req.prompt and req.max_tokens and int(state.n_tokens[0]) == 0:
            raise EmptyContext("the session is empty and the model has no BOS token: send a prompt")
        return Row(
            req, state, loaded, make_generator(req.seed), self.tokenizer.stream_decoder(), list(req.prompt)
        )

    def _load(self, stored: Stored) -> State:
        t0 = time.perf_counter()
        state = self.lm.load_state(stored.snapshot, stored.deltas).compact()
        self.counters.load_seconds += time.perf_counter() - t0
        # a state that has consumed another number of tokens than its session records
        # (say, its deltas were lost) would silently fork the conversation: refuse it
        if int(state.n_tokens[0]) != stored.n_tokens:
            raise StateError(
                f"the stored state has consumed {int(state.n_tokens[0])} tokens, its session records "
                f"{stored.n_tokens}: its stored parts are inconsistent"
            )
        return state

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, rows: list[Row], size: int) -> None:
        """Consume the next `size` prompt tokens of every row, as one batch."""
        chunk = torch.tensor([r.pending[:size] for r in rows], dtype=torch.long, device=self.lm.device)
        want = any(r.req.prompt_logprobs for r in rows)
        if len(rows) == 1:
            lps, state = self.lm.prefill(chunk, rows[0].state, logprobs=want)
            states = [state]
        else:
            lps, batch = self.lm.prefill(chunk, self.lm.stack_states([r.state for r in rows]), logprobs=want)
            states = self.lm.split_state(batch)
        for i, (r, st) in enumerate(zip(rows, states, strict=True)):
            r.state = st
            r.pending = r.pending[size:]
            if r.req.prompt_logprobs and lps is not None:
                r.prompt_logprobs += [None if math.isnan(x) else x for x in lps[i].tolist()]
        self.counters.prefill_tokens += size * len(rows)

    # -- decode ------------------------------------------------------------------------------
    def decode(self, rows: list[Row]) -> None:
        """One token for every row: sample from each row's state, then consume the samples."""
        batch = self._rebatch(rows)
        logits = self.lm.next_logits(batch)  # (B, V)
        ids, logprobs = sample(logits, [r.req.params for r in rows], [r.generator for r in rows])
        for r, tid, lp in zip(rows, ids.tolist(), logprobs.tolist(), strict=True):
            self._on_token(r, tid, lp)
        # the tokens go out now, so the event loop streams them while the forward below
        # runs (its kernels release the GIL), rather than after it
        self.outbox.flush()
        _, self._batch = self._decode(ids[:, None], batch)
        c = self.counters
        c.decode_steps += 1
        c.decode_tokens += len(rows)
        c.max_batch = max(c.max_batch, len(rows))
        if any(r.finish_reason is not None for r in rows):
            self._unbatch()

    def _rebatch(self, rows: list[Row]) -> State:
        """The stacked state of `rows` (re-stacked only when the membership changed)."""
        if self._batch is None or [id(r) for r in self._members] != [id(r) for r in rows]:
            self._unbatch()
            self._members = list(rows)
            self._batch = self.lm.stack_states([r.state for r in rows])
        return self._batch

    def _unbatch(self) -> None:
        """Give every member its own row of the batch back."""
        if self._batch is not None:
            for r, st in zip(self._members, self.lm.split_state(self._batch), strict=True):
                r.state = st
        self._batch, self._members = None, []

    def _on_token(self, r: Row, tid: int, logprob: float) -> None:
        r.ids.append(tid)
        text = r.decoder.feed(tid)
        start = max(0, len(r.text) - max((len(s) for s in r.req.stop), default=0) + 1)
        r.text += text
        eos = self.tokenizer.eos_id
        if eos is not None and tid == eos:
            r.finish_reason = "eos"
        elif any(s in r.text[start:] for s in r.req.stop):
            r.finish_reason = "stop"
        elif len(r.ids) >= r.req.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            # the last token carries any undecodable tail, so token texts always add up to done.text
            tail = r.decoder.flush()
            text += tail
            r.text += tail
        self.outbox.put(r.req, TokenEvent(len(r.ids) - 1, tid, text, logprob))

    # -- the end -----------------------------------------------------------------------------
    def finish(self, r: Row) -> Finished:
        """The outcome of a row that is done: its own state (owning its memory, as a cache
        keeps it) and the bytes its commit must write."""
        if r in self._members:
            self._unbatch()
        state = r.state.compact()
        encoded = None
        if r.req.persist is not None:
            t0 = time.perf_counter()
            encoded = encode(state, r.req.persist)
            state = self._as_stored(state, r.req.persist.dtype)
            self.counters.encode_seconds += time.perf_counter() - t0
        return Finished(
            r.text, r.finish_reason or "length", r.ids, r.prompt_logprobs, state, encoded, r.loaded
        )

    def _as_stored(self, state: State, dtype: str) -> State:
        """`state` exactly as a replica that loads its stored bytes gets it: stored in a
        narrower dtype than it computes in (bfloat16, say), its float tensors are rounded
        through that dtype and its caches rebuilt from them. The session's next request
        then continues the same way whichever replica serves it, hot or from Redis."""
        stored = STORAGE_DTYPES[dtype]
        kept = {name: state.tensors[name] for name in state.persistent}
        if all(t.dtype == stored for t in kept.values() if t.is_floating_point()):
            return state
        return self.lm.rebuild_state(
            {name: t.to(stored).to(t.dtype) if t.is_floating_point() else t for name, t in kept.items()}
        )

    def reset(self) -> None:
        """Forget the batch (after a failed step, whose rows have all left)."""
        self._batch, self._members = None, []
