"""Where a Responses API turn starts: what it continues (its base, read in one go), how its
input is rendered (its turn alone under its base's frame, else the whole conversation) and
which session its generation runs in (the chain's own in place, a fork of its base's
version, the conversation's session, or a new one found as a stateless request's is).
app/sessions/responses.py's docstring walks the whole; this module is its first half, and
`Responses` (the transaction around the generation) the second. It never renders a
template or knows HTTP: the caller hands it `Render`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from app import metrics, prefixes
from app.store import ObjectNotFound, ResponseRecord, ResponseStore, SessionNotFound, VersionGone, Walk

from .choices import stateless
from .service import SessionService


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


class Starts:
    """A response's start, from its turn: `base` reads what it continues, `plan` finds
    where its generation starts."""

    def __init__(self, service: SessionService, store: ResponseStore):
        self.service = service
        self.store = store

    async def base(
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

    async def plan(
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
