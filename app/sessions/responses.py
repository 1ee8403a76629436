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

Where a turn starts (its base, its rendering, its session) is app/sessions/starts.py. The
records live in app/store/responses.py; the conversations in conversations.py; a
background response's worker in background.py. This module never renders a template,
frames an event or knows HTTP: the caller hands it `Render` and the response's body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from app import metrics, prefixes
from app.store import (
    ConversationRecord,
    ObjectNotFound,
    ResponseRecord,
    ResponseStore,
    SessionBusy,
    SessionNotFound,
    VersionMismatch,
)

from .run import Run
from .service import Generation, SessionService
from .starts import Render, Start, Starts, Turn, messages

log = logging.getLogger("recur.responses")


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
        self.starts = Starts(service, store)

    # -- a response's life ------------------------------------------------------------------------
    async def begin(self, response_id: str, turn: Turn, render: Render, gen: Generation) -> Begun:
        """Start the response's generation: admitted (the client's streams and the tenant's
        tokens), then its base read, its input rendered (its turn alone where it can be, else
        with the whole conversation), its starting session found (see the module). The caller
        owns `Begun.run`, and calls `finish` after its commit (or `discard`)."""
        # admission first: a client past its streams or tokens is refused before any read or fork
        async with self.service.tenants.starting(turn.owner, 1, gen.max_tokens) as admitted:
            base, own, whole, seen = await self.starts.base(turn, render)
            plan, seen = await self.starts.plan(turn, base, own, whole, seen, render)
            try:
                run = await self._generate(plan.start, render, gen, turn.owner)
            except (VersionMismatch, SessionBusy, SessionNotFound):
                if not plan.start.in_place:
                    raise
                # the chain went on from the base (another continuation of it), or is going on
                # now: this one forks the base's version instead
                plan, seen = await self.starts.plan(turn, base, own, whole, seen, render, in_place=False)
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
