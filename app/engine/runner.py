"""The runner: executes what the scheduler chose, one step at a time, on the engine thread.

It loads a request's starting state, consumes prompt chunks (`LanguageModel.prefill`,
the same step `LanguageModel.consume` takes), and runs the decode step: one forward pass
for every decoding row together, sampling with per-row parameters, detokenising and
stop matching, in the style of gpt-fast's `decode_one_token`. Rows with different
sampling controls share the step: the sampler (`model.sampling.draw`) applies each
row's own, and what the penalties and min_tokens need of each row's request (a
`model.sampling.Context`) is kept on the batch, built when the batch's membership
changes and advanced in place each step. A row with a grammar (`Request.grammar`) has the
tokens it does not allow masked out of its logits before the draw, and its matcher is
handed the token once read back; the other rows of the step are not touched, and the
masks are computed in llguidance's threads, without the GIL (`model/grammar.py`). A
step reads the device back once: the
sampled ids, their log-probs and any alternatives together. A finished row's state is
split out of the batch, and the encoder thread encodes it (`app/engine/encoder.py`).

The rows' states are kept stacked between decode steps (`lm.stack_states`) and split
(`lm.split_state`) only when the batch's membership changes. Batching changes no
result: each row's logits depend only on its own state.

The runner decides nothing (that is the scheduler's job) and never blocks on the event
loop; it imports only `model/` and the engine's own modules.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat

import torch
import torch.nn.functional as F

from model import Execution, LanguageModel, State
from model.grammar import fill as grammar_masks
from model.grammar import mask_logits
from model.sampling import Context, Draw, make_generator
from model.sampling import draw as draw_tokens
from model.tokenizer import StreamDecoder, Tokenizer

from .compiler import DecodeStep
from .requests import (
    Alternatives,
    EmptyContext,
    EngineError,
    FinishReason,
    NonFinite,
    Outbox,
    Parsed,
    Request,
    TokenEvent,
)

log = logging.getLogger("recur.engine")


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
    prompt_top: list[Alternatives] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None

    @property
    def decoding(self) -> bool:
        """Its prompt is consumed and it still samples tokens."""
        return not self.pending and self.finish_reason is None and self.req.max_tokens > 0


@dataclass(frozen=True)
class Plan:
    """One engine step as the scheduler chose it (`Scheduler.schedule`), which the runner
    executes (`Runner.execute`): as vLLM's `SchedulerOutput`."""

    prefill: list[tuple[int, list[Row]]]  # (chunk length, the rows that consume a chunk that long)
    decode: list[Row]  # the rows that sample a token: those decoding, then those this prefill readies


@dataclass(frozen=True)
class Done:
    """A row that has left the batch, with its own state: what `Encoder.seal` reads."""

    row: Row
    state: State


@dataclass
class Counters:
    """What the runner has done, for the metrics (read from other threads, never reset)."""

    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    max_batch: int = 0
    load_seconds: float = 0.0  # turning parsed tensors into live states (the engine thread)
    parse_seconds: float = 0.0  # parsing and verifying stored bytes (the loader thread alone)
    encode_seconds: float = 0.0  # turning states into commit bytes (the encoder thread alone)
    grammar_seconds: float = 0.0  # computing and applying grammar masks (the engine thread)
    grammar_rows: int = 0  # constrained rows sampled


class Runner:
    def __init__(self, lm: LanguageModel, tokenizer: Tokenizer, decode: DecodeStep, outbox: Outbox):
        self.lm = lm
        self.outbox = outbox
        self.tokenizer = tokenizer
        self._decode = decode  # the one-token forward, eager or compiled (`DecodeStep`)
        self._batch: State | None = None  # stacked states of _members, row i = _members[i]
        self._members: list[Row] = []
        self._context: Context | None = None  # what _members' samplers need of their requests
        self._failed: dict[int, tuple[Row, Exception]] = {}  # rows failed alone, by id, until taken
        self.counters = Counters()

    # -- admission ---------------------------------------------------------------------------
    def load(self, req: Request) -> Row:
        """The request's starting state, ready to run. Raises StateError or EmptyContext."""
        loaded = None
        if req.start is None:
            state = self.lm.new_state(1)
        elif isinstance(req.start, Parsed):
            state = loaded = self._load(req.start)
        elif isinstance(req.start, State):
            state = req.start
        else:  # (the engine hands every Stored start to its loader thread first)
            raise EngineError("a stored start reached the engine thread unparsed")
        if not req.prompt and req.max_tokens and int(state.n_tokens[0]) == 0:
            raise EmptyContext("the session is empty and the model has no BOS token: send a prompt")
        return Row(
            req, state, loaded, make_generator(req.seed), self.tokenizer.stream_decoder(), list(req.prompt)
        )

    def _load(self, parsed: Parsed) -> State:
        """The live state of a start the loader thread parsed (`app/engine/loader.py`)."""
        if parsed.error is not None:
            raise parsed.error
        assert parsed.tensors is not None
        t0 = time.perf_counter()
        state = self.lm.rebuild_state(parsed.tensors).compact()
        self.counters.load_seconds += time.perf_counter() - t0
        return state

    def execute(self, plan: Plan) -> list[tuple[Row, Exception]]:
        """Run one step: the plan's prompt chunks, then one decode step for its decoding rows
        (less any whose chunk failed). Returns the rows whose own part failed, each with its
        error; the others went on."""
        for size, rows in plan.prefill:
            try:
                self.prefill(rows, size)  # (a row that fails alone is failed alone)
            except Exception as exc:  # (its retry of each row alone raised)
                log.exception("prefill failed")
                for r in rows:
                    self._fail(r, exc)
        rows = [r for r in plan.decode if id(r) not in self._failed]
        if rows:
            self.decode(rows)
        return self.take_failed()

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, rows: list[Row], size: int) -> None:
        """Consume the next `size` prompt tokens of every row, as one batch; if it raises,
        each row alone, and only a row whose own chunk raises fails (`take_failed`)."""
        try:
            self._prefill(rows, size)
        except Exception as exc:  # (rows change only once the forward has succeeded)
            self._retry_alone(rows, exc, lambda alone: self.prefill(alone, size))

    def _prefill(self, rows: list[Row], size: int) -> None:
        chunk = torch.tensor([r.pending[:size] for r in rows], dtype=torch.long, device=self.lm.device)
        want = any(r.req.prompt_logprobs for r in rows)
        top = max((r.req.top_logprobs for r in rows if r.req.prompt_logprobs), default=0)
        start = rows[0].state if len(rows) == 1 else self.lm.stack_states([r.state for r in rows])

        def run(how: Execution) -> tuple[torch.Tensor | None, list[list[list[tuple[int, float]]]], State]:
            if top:
                return _prefill_top(self.lm, chunk, start, top, how)
            lps, end = self.lm.prefill(chunk, start, want, how)
            return lps, [], end

        lps, tops, state = self._decode.prefill(run)  # the model's compiled parts, where adopted
        states = [state] if len(rows) == 1 else self.lm.split_state(state)
        for i, (r, st) in enumerate(zip(rows, states, strict=True)):
            r.state = st
            r.pending = r.pending[size:]
            if r.req.prompt_logprobs and lps is not None:
                r.prompt_logprobs += [None if math.isnan(x) else x for x in lps[i].tolist()]
                if r.req.top_logprobs:
                    r.prompt_top += [_alternatives(a, r.req.top_logprobs) for a in tops[i]]
        self.counters.prefill_tokens += size * len(rows)

    # -- decode ----------------------------------------------------------------------------
    def decode(self, rows: list[Row]) -> None:
        """One token for every row: sample from each row's state, then consume the samples.
        A row whose part of the step fails (its state yields non-finite logits, or the
        batched step raises and the row's step raises again alone) is failed alone
        (`take_failed`); the others go on."""
        batch, rows = self._rebatch(rows)
        if not rows:
            return
        try:
            d, finite = self._sample(rows, batch)
            sampled = _to_host(d, finite)
        except Exception as exc:  # nothing was sent yet: run each row alone
            self._unbatch()
            self._retry_alone(rows, exc, self.decode)
            return
        held: list[Held] = []  # a first token waits for its step: see _release_first
        for i, (r, (tid, lp, alternatives, ok)) in enumerate(zip(rows, sampled, strict=True)):
            if ok and r.ids:
                self._on_token(r, tid, lp, alternatives[: r.req.top_logprobs])
            elif ok:
                held.append((i, r, tid, lp, alternatives[: r.req.top_logprobs]))
            else:
                self._fail(
                    r, NonFinite("the session's state gives non-finite logits: it cannot be continued")
                )
        # the tokens go out now, so the event loop streams them while the forward below
        # runs (its kernels release the GIL), rather than after it
        self.outbox.flush()
        try:
            _, self._batch = self._decode(d.ids[:, None], batch)
        except Exception as exc:  # the tokens are out: consume each row's alone
            self._consume_alone(rows, d.ids, batch, exc)
        _release_first(self, held)
        c = self.counters
        c.decode_steps += 1
        c.decode_tokens += len(rows)
        c.max_batch = max(c.max_batch, len(rows))
        if any(r.finish_reason is not None or id(r) in self._failed for r in rows):
            self._unbatch()

    def _sample(self, rows: list[Row], batch: State) -> tuple[Draw, torch.Tensor]:
        """Each row's token drawn from the batch's logits, and whether its logits were finite
        (a row's that were not are drawn from zeros, harmlessly, and the row fails)."""
        logits = self.lm.next_logits(batch)  # (B, V)
        finite = torch.isfinite(logits).all(-1)  # (B,)
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        logits = _constrained(rows, logits, self.counters)
        params = [r.req.params for r in rows]
        if self._context is None and any(p.uses_context for p in params):
            self._context = Context.of(
                [r.req.prompt for r in rows],
                [r.ids for r in rows],
                logits.shape[-1],
                eos_id=self.tokenizer.eos_id,
                device=logits.device,
                history=any(p.uses_history for p in params),
            )
        top = max(r.req.top_logprobs for r in rows)
        d = draw_tokens(logits, params, [r.generator for r in rows], self._context, top)
        if self._context is not None:
            self._context.advance(d.ids)
        return d, finite

    def _retry_alone(self, rows: list[Row], exc: Exception, step: Callable[[list[Row]], None]) -> None:
        """A batched step over `rows` raised `exc` before it changed any row's state: run it
        for each row alone, so that only a row whose own step raises fails."""
        if len(rows) == 1:
            self._fail(rows[0], exc)
            return
        for r in rows:
            if id(r) not in self._failed:
                step([r])

    def _consume_alone(self, rows: list[Row], ids: torch.Tensor, batch: State, exc: Exception) -> None:
        """The batched forward raised `exc` after the sampled tokens went out: consume each
        row's token in a forward of its own (`batch`, the state before, is untouched)."""
        self._batch, self._members, self._context = batch, list(rows), None
        self._unbatch()
        for i, r in enumerate(rows):
            if id(r) in self._failed:
                continue
            try:
                _, r.state = self._decode(ids[i : i + 1, None], r.state)
            except Exception as alone:
                self._fail(r, alone if len(rows) > 1 else exc)

    def _rebatch(self, rows: list[Row]) -> tuple[State, list[Row]]:
        """The stacked state of `rows` (re-stacked only when the membership changed), and the
        rows in it: those that did not fail while the old batch was split."""
        if self._batch is None or [id(r) for r in self._members] != [id(r) for r in rows]:
            self._unbatch()
            rows = [r for r in rows if id(r) not in self._failed]
            self._members = list(rows)
            self._batch = self.lm.stack_states([r.state for r in rows]) if rows else None
        assert self._batch is not None or not rows
        return self._batch, rows  # type: ignore[return-value]

    def _unbatch(self) -> None:
        """Give every member its own row of the batch back. If splitting the batch fails,
        it is split row by row, and only a row that cannot be split fails."""
        batch, members = self._batch, self._members
        self._batch, self._members, self._context = None, [], None
        if batch is None:
            return
        try:
            states: list[State | Exception] = list(self.lm.split_state(batch))
        except Exception:
            states = [self._split_row(batch, i) for i in range(len(members))]
        for r, st in zip(members, states, strict=True):
            if isinstance(st, Exception):
                self._fail(r, st)
            else:
                r.state = st

    def _split_row(self, batch: State, i: int) -> State | Exception:
        try:
            return self.lm.split_state(batch.replace(**{k: t[i : i + 1] for k, t in batch.tensors.items()}))[
                0
            ]
        except Exception as exc:
            return exc

    # -- rows that failed alone ------------------------------------------------------------
    def _fail(self, r: Row, exc: Exception) -> None:
        self._failed[id(r)] = (r, exc)

    def take_failed(self) -> list[tuple[Row, Exception]]:
        """The rows that failed alone since the last call (each must leave the scheduler)."""
        failed, self._failed = list(self._failed.values()), {}
        return failed

    def _on_token(self, r: Row, tid: int, logprob: float, top: Alternatives) -> None:
        r.ids.append(tid)
        if r.req.grammar is not None:  # (before the next step's mask is asked of it)
            r.req.grammar.consume(tid)
        p = r.req.params
        # min_tokens keeps EOS and stop ids from being drawn; stop strings wait for it here
        eos = tid == self.tokenizer.eos_id and not p.ignore_eos
        stop_token = eos or tid in p.stop_token_ids
        stop_text = ""
        if stop_token:  # its own text apart from what the tokens before it left undecoded
            text = r.decoder.flush()
            stop_text = r.decoder.feed(tid) + r.decoder.flush()
            text += stop_text
        else:
            text = r.decoder.feed(tid)
        start = max(0, len(r.text) - max((len(s) for s in r.req.stop), default=0) + 1)
        r.text += text
        if stop_token:
            r.finish_reason = "eos" if eos else "stop"
        elif len(r.ids) >= p.min_tokens and any(s in r.text[start:] for s in r.req.stop):
            r.finish_reason = "stop"
        elif len(r.ids) >= r.req.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            # the last token carries any undecodable tail, so token texts always add up to done.text
            tail = r.decoder.flush()
            text += tail
            r.text += tail
        self.outbox.put(r.req, TokenEvent(len(r.ids) - 1, tid, text, logprob, top, stop_text))

    # -- the end -----------------------------------------------------------------------------
    def finish(self, r: Row) -> Done:
        """A row that is done leaves the batch with its own state (owning its memory, as a
        cache keeps it). Its outcome is sealed off the engine thread (`Encoder.seal`)."""
        if r in self._members:
            self._unbatch()
        if id(r) in self._failed:
            raise self._failed.pop(id(r))[1]
        return Done(r, r.state.compact())

    def reset(self) -> None:
        """Forget the batch (after a failed step, whose rows have all left)."""
        self._batch, self._members, self._context = None, [], None
        self._failed = {}


def _constrained(rows: list[Row], logits: torch.Tensor, counters: Counters) -> torch.Tensor:
    """`logits` with each constrained row's disallowed tokens at -inf (its grammar's mask,
    computed with every other constrained row's in llguidance's threads); others untouched."""
    constrained = [i for i, r in enumerate(rows) if r.req.grammar is not None]
    if not constrained:
        return logits
    t0 = time.perf_counter()
    masks = grammar_masks([rows[i].req.grammar for i in constrained], logits.shape[-1])  # type: ignore[misc]
    logits = mask_logits(logits, constrained, masks)
    counters.grammar_seconds += time.perf_counter() - t0
    counters.grammar_rows += len(constrained)
    return logits


def _prefill_top(
    lm: LanguageModel, chunk: torch.Tensor, state: State, top: int, how: Execution
) -> tuple[torch.Tensor, list[list[list[tuple[int, float]]]], State]:
    """`LanguageModel.prefill` with logprobs, written out to keep each position's whole
    distribution for its `top` most probable tokens (only for a request that asks for
    the prompt's alternatives: the usual prefill keeps only the tokens' own)."""
    had_context = state.n_tokens > 0  # read before the forward, which may grow it in place
    first = lm.next_logits(state)  # (B, V): predicts the chunk's first token
    logits, state = lm(chunk, state, how)  # (B, T, V): position i predicts token i + 1
    lp = F.log_softmax(torch.cat([first[:, None], logits[:, :-1]], 1).float(), -1)  # (B, T, V)
    own = lp.gather(2, chunk[..., None])[..., 0]
    own[:, 0] = torch.where(had_context, own[:, 0], torch.full_like(own[:, 0], float("nan")))
    values, ids = lp.topk(min(top, lp.shape[-1]), -1)  # (B, T, k)
    pairs = torch.stack([ids.double(), values.double()], -1).tolist()  # (B, T, k, 2)
    for b in range(len(pairs)):
        if not bool(had_context[b]):
            pairs[b][0] = []  # no context, no distribution
    return own, pairs, state


Held = tuple[int, Row, int, float, Alternatives]  # a first token: its row's index in the batch, and it


def _release_first(runner: Runner, held: list[Held]) -> None:
    """Send each row's first token once the step that consumed it left the row's state
    finite, else fail the row with no token sent. A state whose first step overflows (an
    imported one, near float32's limit) would otherwise stream a token and then an error
    for the text it had just shown. (A state that overflows later fails at the next step's
    logits check, after the tokens drawn from finite states.)"""
    for i, r, tid, lp, alternatives in held:
        if id(r) in runner._failed:
            continue
        own = runner._split_row(runner._batch, i) if runner._batch is not None else r.state
        if isinstance(own, Exception) or not own.finite():
            runner._fail(r, NonFinite("this step made the session's state non-finite: it was not committed"))
        else:
            runner._on_token(r, tid, lp, alternatives)
    if held:
        runner.outbox.flush()


def _to_host(d: Draw, finite: torch.Tensor) -> list[tuple[int, float, Alternatives, bool]]:
    """Each row's (token id, behaviour log-prob, alternatives, whether its logits were
    finite), read back in one transfer (float64 holds token ids and float32 log-probs
    exactly). Alternatives the row could not have drawn (-inf) are left out."""
    parts = [d.ids[None].double(), d.logprobs[None].double(), finite[None].double()]  # (1, B) each
    if d.top_ids is not None and d.top_logprobs is not None:
        parts += [d.top_ids.T.double(), d.top_logprobs.T.double()]  # (k, B) each
    cols = torch.cat(parts).tolist()
    ids, oks = [int(i) for i in cols[0]], [bool(x) for x in cols[2]]
    k = (len(cols) - 3) // 2
    if not k:
        return list(zip(ids, cols[1], repeat(()), oks))
    top_ids, top_lps = zip(*cols[3 : 3 + k], strict=True), zip(*cols[3 + k :], strict=True)
    return [
        (i, lp, _alternatives(list(zip(t, v, strict=True)), k), ok)
        for i, lp, t, v, ok in zip(ids, cols[1], top_ids, top_lps, oks, strict=True)
    ]


def _alternatives(pairs: list, k: int) -> Alternatives:
    """(id, log-prob) pairs as read back, the first `k` with a finite log-prob."""
    return tuple((int(t), lp) for t, lp in pairs[:k] if lp != float("-inf"))
