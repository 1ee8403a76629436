"""The Responses API's transactions: a response is a session version.

A response continues the state an earlier one committed (`previous_response_id`), or a
conversation's session, or (neither) a new session found as a stateless request's is
(prefix reuse). A later turn renders, tokenizes and reads only its own input: its base's
record says which ids close the base's reply after its state (`Render.closing`: none when
the state consumed the turn stop, the stop when the reply was cut short) and the frame it
was rendered under (instructions, tools, template); under the same frame the turn prefills
those ids and its own messages rendered alone (`Render.continuation`), which for a template
that composes is what the whole conversation renders to after the state's tokens
(tests/app/test_turn_rendering.py). Otherwise the whole conversation is rendered (the
chain's turns, walked in the same read; a conversation's items), and the stored state is
continued only if the tokens it consumed (its chained hash, app/prefixes.py) are a prefix
of those; then only the rest is prefilled; else (the state expired, a conversation's item
was deleted, the instructions changed, a reply ended on a token the text does not show) the
whole conversation is prefilled in a new session. Either way the reply is the one resending
the whole conversation would give.

A stored response continues its chain in place: the session the earlier response
committed to, fenced on that response's version (its record vouches for the tokens that
state consumed, so nothing is read first, and the hot cache holds the state): the turn
writes what it added, a delta, and the session is held by every stored response whose
state it holds (`hold`, app/store/lua/session.lua), until the last one is deleted. A second
continuation of the same response (the chain has gone on from it), or one while another
runs, forks that version instead, as every continuation did before: two continuations of
one response are two sessions, never a conflict. A version past the session's kept ones
(`history_versions`) is prefilled anew. A response with `conversation` continues the
conversation's session in place (fenced on its version). A response not stored
(`store: false`) forks, and deletes every session it made.

The records live in app/store/responses.py; the conversations in conversations.py; a
background response's worker in background.py. This module never renders a template,
frames an event or knows HTTP: the caller hands it `Render` and the response's body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from app import metrics, prefixes
from app.store import (
    ConversationRecord,
    ObjectNotFound,
    ResponseRecord,
    ResponseStore,
    SessionBusy,
    SessionNotFound,
    VersionGone,
    VersionMismatch,
    Walk,
)

from .choices import stateless
from .run import Run
from .service import Generation, SessionService

log = logging.getLogger("recur.responses")


class Render(Protocol):
    """The caller's rendering of a conversation, and its bound on what a turn prefills."""

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        """Messages (role and content, as chat templates read them) and whether the
        assistant's turn opens after them -> the token ids they render to (no BOS), the
        whole conversation's: no bound on its length."""
        ...

    @property
    def frame(self) -> str:
        """A digest of what the conversation is rendered under, besides its messages (the
        instructions, the tools offered, the template): a later turn renders alone only
        under its stored state's frame; '' where the template does not render a
        conversation turn by turn as it renders it whole (never alone)."""
        ...

    def continuation(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The token ids of a later turn's `messages` alone, the assistant's turn opening
        after them, continuing a state that ends at a reply's turn stop; None where the
        template does not render a conversation turn by turn as it renders it whole."""
        ...

    def closing(self, reply: dict[str, Any], ids: list[int]) -> list[int] | None:
        """Where `ids`, the tokens a state consumed after the generation prompt, begin the
        assistant's `reply` as the template writes it through its turn stop, tokenized
        alike whatever turn follows: the ids that close it after them ([] : none, the state
        consumed the turn stop; a reply cut short: the rest of it). A later turn then
        renders alone (`continuation`), after those. None: it cannot."""
        ...

    def new(self, ids: list[int]) -> list[int]:
        """`ids`, the tokens a turn prefills, or the caller's refusal when they are more
        than it takes in one request: the bound is on a turn's new tokens, never on the
        conversation's total (a chain would die at the bound, however short its turns)."""
        ...


CONTINUABLE = ("completed", "incomplete")


class NotContinuable(Exception):
    """A response or conversation that cannot be continued as asked (400)."""


def message(item: dict) -> dict[str, Any]:
    """An item as a chat template reads it (HF's convention): a message's role, and its
    content's text parts joined by newlines (as the chat route joins a message's parts); a
    `function_call` as an assistant's message with `tool_calls`; a `function_call_output`
    as a `tool` message."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"name": str(item["name"]), "arguments": str(item.get("arguments") or "{}")}
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": str(item["call_id"]), "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        return {
            "role": "tool",
            "tool_call_id": str(item["call_id"]),
            "content": _text(item.get("output", "")),
        }
    return {"role": str(item["role"]), "content": _text(item.get("content", ""))}


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))  # type: ignore[attr-defined]


def messages(items: list[dict]) -> list[dict[str, Any]]:
    """Items as a chat template reads them (`message`), an assistant's message and the calls
    that follow it (parallel calls are items of their own) made one message, as the model
    wrote them in one reply."""
    out: list[dict[str, Any]] = []
    for item in items:
        m = message(item)
        last = out[-1] if out else None
        if m.get("tool_calls") and last is not None and last["role"] == "assistant":
            out[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), *m["tool_calls"]]}
        else:
            out.append(m)
    return out


@dataclass
class Turn:
    """What a response asks: the owner, its new input items (each with an id), what it
    continues, and whether it is kept."""

    owner: str
    input: list[dict]
    previous: str | None = None
    conversation: str | None = None
    store: bool = True
    background: bool = False


@dataclass
class Base:
    """The stored state a response may continue: a session at a version, and the hash of
    the tokens it consumed (app/prefixes.py; '' when the record does not say)."""

    session: str
    version: int
    n_tokens: int
    tokens_hash: str = ""
    digest: str = ""  # the same tokens' one-pass digest (`prefixes.digest`; '' when not kept)
    frame: str = ""  # what its conversation was rendered under (`Render.frame`)
    closing: list[int] | None = None  # what closes its reply after its state (`Render.closing`)


@dataclass
class Plan:
    """Where a response starts, and how its input was rendered."""

    start: Start
    rendered: list[int] | None  # the whole conversation's tokens (BOS included), rendered whole
    input_tokens: int  # the whole input's tokens, the conversation's (BOS not counted)


@dataclass
class Start:
    """Where a response's generation starts: the session, the ids it has yet to consume,
    whether the session is the response's own (`made`: a fork or a new one) or the chain's
    it continues in place, and the version it must still be at."""

    session: str
    rest: list[int]
    made: bool
    expected: int | None = None
    in_place: bool = False


@dataclass
class Begun:
    """A response whose generation has started."""

    id: str
    turn: Turn
    run: Run
    render: Render
    own: list[dict[str, Any]]  # its turn's messages (a conversation's items added since, its input)
    rendered: list[int] | None  # the whole conversation's tokens (BOS included) when rendered whole
    input_tokens: int  # the whole input's tokens (BOS not counted)
    cached: int  # of those, the ones its starting state already held: not prefilled
    made: bool  # the session is the response's own (a fork or a new one)
    in_place: bool = False  # it continues its chain's session, which it holds with the others
    holds: bool = False  # its commit keeps the session, and leaves its settlement to `finish`
    replaced: str | None = None  # a conversation's former session, which this one replaces
    seen: int | None = None  # a conversation's items it read through (its turn follows them)
    resolved: bool = False  # `finish` kept it, or `discard` dropped it: closing deletes nothing more
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def own_session(self) -> str:
        """The session the response made ('' when it runs in a conversation's own)."""
        return self.run.writer.meta.id if self.made else ""


class Responses:
    def __init__(self, service: SessionService, store: ResponseStore, retention: int):
        self.service = service
        self.store = store
        self.retention = retention

    # -- a response's life ------------------------------------------------------------------------
    async def begin(self, response_id: str, turn: Turn, render: Render, gen: Generation) -> Begun:
        """Start the response's generation: admitted (the client's streams and the tenant's
        tokens), then its base read, its input rendered (its turn alone where it can be, else
        with the whole conversation), its starting session found (see the module). The caller
        owns `Begun.run`, and calls `finish` after its commit (or `discard`)."""
        # admission first: a client past its streams or tokens is refused before any read or fork
        async with self.service.tenants.starting(turn.owner, 1, gen.max_tokens) as admitted:
            base, own, whole, seen = await self._base(turn, render)
            plan, seen = await self._plan(turn, base, own, whole, seen, render)
            try:
                run = await self._generate(plan.start, render, gen, turn.owner)
            except (VersionMismatch, SessionBusy, SessionNotFound):
                if not plan.start.in_place:
                    raise
                # the chain went on from the base (another continuation of it), or is going on
                # now: this one forks the base's version instead
                plan, seen = await self._plan(turn, base, own, whole, seen, render, in_place=False)
                run = await self._generate(plan.start, render, gen, turn.owner)
        admitted(run)
        start = plan.start
        holds = turn.store and (start.made or start.in_place)
        if holds:  # (its commit keeps the session as long as the response, and holds it)
            run.keep_as(self.retention, response_id)
        replaced = base.session if turn.conversation and base and start.made else None
        return Begun(response_id, turn, run, render, own, plan.rendered, plan.input_tokens,
                     plan.input_tokens - len(start.rest), start.made, start.in_place, holds, replaced, seen)  # fmt: skip

    async def _generate(self, start: Start, render: Render, gen: Generation, owner: str) -> Run:
        """The run of a response's generation from `start` (a session it made is deleted if
        the run does not start)."""
        try:
            rest = render.new(start.rest)
            return await self.service.generate(start.session, rest, gen, expected=start.expected, owner=owner)
        except BaseException:
            if start.made:
                await self._forget(owner, start.session)
            raise

    async def finish(
        self,
        begun: Begun,
        body: dict,
        reply: dict[str, Any],
        output: list[dict],
        *,
        worker: bool = False,
        events: int = 0,
    ) -> bool:
        """Keep a committed response: its record (`body`, the API's Response object, and
        `reply`, its output as a message the template reads), and with a conversation, its input and `output` items appended to it. Not stored, its
        sessions are deleted. `worker`: a background worker's, kept only while the response
        is active (else discarded: False); `events`: the bytes of its kept events, counted
        in the key's quota with the record."""
        turn, meta = begun.turn, begun.run.meta
        status = str(body["status"])
        metrics.RESPONSES.labels(status).inc()
        if not turn.store or meta is None:  # not stored, or failed: no state to keep
            await self.discard(begun)
            if meta is None and turn.store:
                failed = ResponseRecord(status=status, body=body)
                await self.store.save(begun.id, turn.owner, self.retention, failed, worker=worker)
            return True
        bos = len(self.service.with_bos([]))
        record = _record(begun, body, reply, bos)
        consumed, closes = record.digest or "", record.closing or ""
        own_turn = [*messages(turn.input), reply]  # (a conversation's items stay in its list)
        parent = turn.previous or turn.conversation or ""
        nbytes = sum(map(len, record.to_fields().values())) + events + len(json.dumps(own_turn))
        tenants = self.service.tenants
        if begun.holds:  # the session's settlement, deferred by its commit, and the record's place
            await tenants.settle_kept(
                turn.owner, meta, self.service.prefix_reuse, begun.id, nbytes, self.retention
            )
        else:
            await tenants.reserve(turn.owner, begun.id, nbytes, self.retention)
        saved = await self.store.save(
            begun.id, turn.owner, self.retention, record, worker=worker, turn=own_turn, parent=parent
        )
        if not saved:
            await self.discard(begun)
            return False
        begun.resolved = True  # (its commit kept the session as long as the response, `keep_as`)
        if turn.conversation:
            await self._extend_conversation(begun, [*turn.input, *output], consumed, closes)
        return True

    async def close(self, begun: Begun) -> None:
        """Always, once a response's request ends (a background one's too: cancelled, deleted
        or failed): its generation stopped, its lock released, and then, unless `finish` kept
        it or `discard` ran already, the session it made deleted."""
        if begun.resolved:
            await begun.run.close()
        else:
            await self.discard(begun)

    async def discard(self, begun: Begun) -> None:
        """Leave nothing of a response behind: its run closed (its lock released), then the
        session it made deleted."""
        begun.resolved = True  # (once)
        run = begun.run
        await run.close()
        if begun.made:
            await self._forget(begun.turn.owner, begun.own_session)
            hashes = [run.writer.meta.tokens_hash, *([run.meta.tokens_hash] if run.meta else [])]
            await self.service.tenants.unindex(begun.turn.owner, begun.own_session, hashes)
        elif begun.in_place and run.meta is not None:  # (its commit held the chain's session)
            await self._forget(begun.turn.owner, run.meta.id, holder=begun.id)

    async def _extend_conversation(self, begun: Begun, items: list[dict], digest: str, closing: str) -> None:
        turn, meta = begun.turn, begun.run.meta
        assert turn.conversation is not None and meta is not None
        count, moved = await self.store.add_items(
            turn.conversation, turn.owner, self.retention, items, begun.seen
        )
        # (items another writer added meanwhile came before this turn's, unread by its state:
        # the next turn renders the conversation whole)
        state = ConversationRecord(
            session=meta.id, version=meta.version, n_tokens=meta.n_tokens, tokens=meta.tokens_hash,
            digest=digest, frame=begun.render.frame, closing=closing, consumed=0 if moved else count,
        )  # fmt: skip
        await self.store.save(turn.conversation, turn.owner, self.retention, state)
        if begun.replaced:
            await self._forget(turn.owner, begun.replaced)

    # -- reads and deletes ----------------------------------------------------------------------
    async def get(self, owner: str, response_id: str) -> dict:
        """A stored response's body."""
        return (await self.store.read(ResponseRecord, response_id, owner, ResponseRecord.BODY)).response

    async def input_items(self, owner: str, response_id: str) -> list[dict]:
        """The input items the response was given, in order (its own: not its ancestors')."""
        record = await self.store.read(ResponseRecord, response_id, owner, ["input"])
        return record.input or []

    async def delete(self, owner: str, response_id: str) -> None:
        """Delete a response and the state it holds. Its descendants hold their own."""
        record = await self.store.read(ResponseRecord, response_id, owner, ["own"])
        session = await self.store.delete("response", response_id, owner)
        await self.service.tenants.forgotten(owner, response_id)
        if session and record.own:  # (its chain's other responses may still hold it)
            await self._forget(owner, session, holder=response_id)

    # -- the starting state -------------------------------------------------------------------
    async def _base(
        self, turn: Turn, render: Render
    ) -> tuple[Base | None, list[dict[str, Any]], list[dict[str, Any]] | None, int | None]:
        """What a response continues, in one read: the stored state, if any (`Base`), the
        messages of its own turn (a conversation's items since its state, then the input),
        the whole conversation when its turn cannot render alone (None where it may), and a
        conversation's items read through."""
        own = messages(turn.input)
        if turn.previous is not None:
            names = ["session", "version", "n_tokens", "status", "tokens", "digest", "frame", "closing"]
            r, walk = await self.store.base(turn.previous, turn.owner, names, render.frame)
            if r.status not in CONTINUABLE:
                raise NotContinuable(
                    f"previous_response_id: response {turn.previous!r} is {r.status}; only a completed or "
                    "incomplete response can be continued"
                )
            base = Base(r.session or "", r.version or 0, r.n_tokens or 0, r.tokens or "", r.digest or "",
                        r.frame or "", json.loads(r.closing) if r.closing else None)  # fmt: skip
            whole = None if walk is None else [*await _context(self.store, turn, walk), *own]
            return base, own, whole, None
        if turn.conversation is not None:
            names = ["session", "version", "n_tokens", "tokens", "digest", "frame", "closing"]
            items, c, first = await self.store.items(turn.conversation, turn.owner, names, render.frame)
            alone = first > 0 and c.closing
            base = Base(c.session or "", c.version or 0, c.n_tokens or 0, c.tokens or "", c.digest or "",
                        c.frame or "", json.loads(c.closing) if alone and c.closing else None)  # fmt: skip
            own = messages([*items, *turn.input])
            return base, own, None if alone else own, first + len(items)
        return None, own, own, None

    async def _plan(
        self, turn: Turn, base: Base | None, own: list[dict[str, Any]], whole: list[dict[str, Any]] | None,
        seen: int | None, render: Render, in_place: bool = True,
    ) -> tuple[Plan, int | None]:  # fmt: skip
        """Where a response starts: where its base's state ends where a reply closes
        (`closing`), under the frame this turn renders under, its own turn alone continues
        that state (`Render.continuation`, after the closing ids: nothing before it is read,
        rendered or tokenized); else the whole conversation, rendered (`_session`)."""
        ttl = self.service.stateless_ttl  # (until its commit keeps it as long as the response)
        alone = (
            base is not None
            and whole is None
            and base.closing is not None
            and base.tokens_hash
            and base.frame == render.frame
            and not (own and own[0].get("tool_calls"))  # (a call the whole would join to the reply)
        )
        later = render.continuation(own) if alone else None
        if base is not None and base.closing is not None and later is not None:
            in_place = in_place and turn.store and turn.conversation is None
            found = await self._continue(turn, base, base.tokens_hash, ttl, in_place)
            if found is not None:
                metrics.RESPONSE_REUSE.labels("hit").inc()
                bos = len(self.service.with_bos([]))
                metrics.RESPONSE_TOKENS_REUSED.inc(base.n_tokens - bos)
                rest = [*base.closing, *later]
                start = Start(found[0], rest, found[1], found[2], in_place)
                return Plan(start, None, base.n_tokens - bos + len(rest)), seen
        if whole is None:  # (the state is gone, or the turn's first item is a call: a second read)
            whole, seen = await _whole(self.store, turn, own, seen)
        ids = render(whole, True)
        return Plan(
            await self._session(turn, base, ids, in_place), self.service.with_bos(ids), len(ids)
        ), seen

    async def _session(self, turn: Turn, base: Base | None, ids: list[int], in_place: bool = True) -> Start:
        """Where a response starts (`Start`): its base's state if that consumed exactly the
        first tokens of `ids` (with BOS); else a new session, found as a stateless
        request's is. `in_place`: a stored response continues its chain's session itself."""
        ttl = self.service.stateless_ttl  # (until its commit keeps it as long as the response)
        if base is not None:
            tokens = self.service.with_bos(ids)
            n = base.n_tokens
            if (
                base.digest
                and base.tokens_hash
                and n <= len(tokens)
                and prefixes.digest(tokens[:n]) == base.digest
            ):
                held = base.tokens_hash  # (the same tokens: their chained hash is the record's)
            else:  # (a step per token: a record that keeps no digest, or a rendering that differs)
                held = prefixes.extend(prefixes.root(self.service.engine.fingerprint), tokens[:n])
            in_place = in_place and turn.store and turn.conversation is None and base.tokens_hash == held
            found = await self._continue(turn, base, held, ttl, in_place) if n <= len(tokens) else None
            if found is not None:
                metrics.RESPONSE_REUSE.labels("hit").inc()
                metrics.RESPONSE_TOKENS_REUSED.inc(n - (len(tokens) - len(ids)))
                return Start(found[0], tokens[n:], found[1], found[2], in_place)
            metrics.RESPONSE_REUSE.labels("miss").inc()
        session, rest = await stateless(self.service, ids, turn.owner, ttl=ttl)
        return Start(session, rest, True)

    async def _continue(
        self, turn: Turn, base: Base, held: str, ttl: int, in_place: bool
    ) -> tuple[str, bool, int | None] | None:
        """The base's state, if it consumed exactly the tokens hashing to `held`: the
        conversation's session itself (at its version); the chain's session itself, at the
        base's version (`in_place`: the base's record vouched for its tokens, and the fenced
        begin for its version: nothing to read first); or a fork of the base's version."""
        try:
            if in_place:
                return base.session, False, base.version
            if turn.conversation is not None:
                meta = await self.service.get(base.session, turn.owner)
                same = meta.tokens_hash == held and meta.version == base.version
                return (meta.id, False, meta.version) if same else None
            fork = await self.service.fork(
                base.session, None, turn.owner, base.version, ttl=ttl, tokens_hash=held
            )
            return fork.id, True, None
        except (SessionNotFound, VersionGone):
            return None

    async def release(self, owner: str, session_id: str, holder: str = "") -> bool:
        """Delete a session a response made and no longer needs (with `holder`, once no
        other response of its chain holds it): False while a writer holds it (a response
        still running in it: its own close deletes it, or, its replica dead, the next sweep
        once its lock has lapsed)."""
        try:
            await asyncio.shield(self.service.delete(session_id, None, owner, holder))
        except (SessionNotFound, ObjectNotFound):
            pass
        except SessionBusy:
            return False
        return True

    async def _forget(self, owner: str, session_id: str, holder: str = "") -> None:
        """Delete a session, or let go of it as `holder` (best effort: it expires anyway)."""
        try:
            if not await self.release(owner, session_id, holder):
                log.info("session %s of a response is still being written: its writer deletes it", session_id)
        except Exception:
            log.warning("could not delete session %s of a response", session_id, exc_info=True)


async def _whole(
    store: ResponseStore, turn: Turn, own: list[dict[str, Any]], seen: int | None
) -> tuple[list[dict[str, Any]], int | None]:
    """The whole conversation a response's turn ends, read where the first read left it
    out: a chain's turns walked from the previous response, or all of a conversation's
    items; and a conversation's items read through."""
    if turn.previous is not None:
        _, walk = await store.base(turn.previous, turn.owner, ["status"], "")
        assert walk is not None  # (no frame: walked)
        return [*await _context(store, turn, walk), *own], seen
    assert turn.conversation is not None
    items, _, _ = await store.items(turn.conversation, turn.owner, [])
    return messages([*items, *turn.input]), len(items)


async def _context(store: ResponseStore, turn: Turn, walk: Walk) -> list[dict[str, Any]]:
    """The conversation the previous response ended, its own reply included."""
    if walk.broken:
        raise NotContinuable(
            f"previous_response_id: the conversation before response {turn.previous!r} is no longer "
            "stored whole (a response it continues, stored before this server kept turns, was deleted)"
        )
    flat = [m for t in walk.turns for m in t]
    if not walk.root.startswith("conv_"):
        return flat
    # its first response followed a conversation's items: those before its own input
    record = await store.read(ResponseRecord, walk.first, turn.owner, ["input"])
    given = {i.get("id") for i in record.input or []}
    try:
        items, _, _ = await store.items(walk.root, turn.owner, [])
    except ObjectNotFound:
        items = []
    at = next((n for n, i in enumerate(items) if i.get("id") in given), None)
    if at is None:
        raise NotContinuable(
            f"previous_response_id: response {turn.previous!r} continues conversation {walk.root!r}, whose "
            "items before it are no longer stored"
        )
    return [*messages(items[:at]), *flat]


def _record(begun: Begun, body: dict, reply: dict[str, Any], bos: int) -> ResponseRecord:
    """A committed response's record: its state, how its reply closes after that state
    (`Render.closing`), and, when its conversation was rendered whole, the digest of what the
    state consumed."""
    meta = begun.run.meta
    assert meta is not None
    prefilled = bos + begun.input_tokens  # (the state's, before the reply)
    reply_ids = [ev.id for ev in begun.run.tokens][: meta.n_tokens - prefilled]
    closing = begun.render.closing(reply, reply_ids) if meta.n_tokens > prefilled else None
    return ResponseRecord(
        status=str(body["status"]),
        body=body,
        input=begun.turn.input,
        session=meta.id,
        version=meta.version,
        n_tokens=meta.n_tokens,
        tokens=meta.tokens_hash,
        digest=prefixes.digest([*begun.rendered, *reply_ids]) if begun.rendered is not None else "",
        frame=begun.render.frame,
        closing="" if closing is None else json.dumps(closing),
        own=begun.made or begun.in_place,
        created_at=begun.created_at,
    )
