"""Responses and conversations in Redis (the Responses and Conversations APIs): each on its
own keys (a chain's `{resp_HEX}`, `{conv_HEX}`: app/store/keys.py), never a session's, so
each script here touches one slot.

A response is a hash (its body, its session and version: a `ResponseRecord`,
app/store/records.py), its own turn in its chain's hash (the conversation it ends is the
turns found by walking its parents: a turn is written once, by the response that made it),
and, when it runs in the background, a Redis Stream of its events (read a page at a time, and waited on with `XREAD BLOCK`); a
conversation is a hash (a `ConversationRecord`) and a list of its items. The state they continue lives in sessions (app/store/sessions.py):
the hash only names it. A background worker writes only while its response is active, so
a cancel, or a failure written by another replica's sweep once the worker's lease lapsed,
always wins. This module knows nothing of HTTP, tensors or the model.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .connection import Connection
from .keys import Keys, chain_of
from .records import ConversationRecord, ObjectKind, R, ResponseRecord
from .types import ObjectNotFound, fields

ACTIVE = ("queued", "in_progress")


def new_object_id(prefix: str) -> str:
    """An id as OpenAI's look: `resp_`, `conv_`, `msg_` and 32 random hex digits."""
    return f"{prefix}_{secrets.token_hex(16)}"


def new_op_id() -> str:
    """Names one write of a stored object, so that its retry knows its first run (stored.lua)."""
    return secrets.token_hex(8)


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Expired:
    """What `ResponseStore.expire` found: `status` 'failed' (it failed the response), 'alive'
    (its lease was renewed) or 'gone' (it had ended, or is no more); its `owner`; and the
    session its run made and it does not keep (`orphan`, '' if none), to delete."""

    status: str
    owner: str
    orphan: str


@dataclass(frozen=True)
class Walk:
    """The conversation a stored response ends, as its chain's turns (chain.lua): `turns`
    oldest first, each a list of messages (a response stored before chains gives its whole
    `context` as one); `root` where the first came from ('' the conversation's start,
    'conv_…' a conversation's items, else a response stored before chains); `first` the
    response whose turn is the first; `broken`: a turn is gone (a response stored before
    chains, deleted)."""

    turns: list[list[dict]]
    root: str
    first: str
    broken: bool = False


class ResponseStore:
    def __init__(self, connection: Connection, keys: Keys):
        self.connection = connection
        self.keys = keys

    def _keys(self, kind: ObjectKind, object_id: str) -> list[str]:
        return self.keys.response(object_id) if kind == "response" else self.keys.conversation(object_id)

    # -- either kind --------------------------------------------------------------------------
    async def save(
        self,
        object_id: str,
        owner: str,
        ttl: int,
        record: ResponseRecord | ConversationRecord,
        *,
        worker: bool = False,
        turn: list[dict] | None = None,
        parent: str = "",
        op: str = "",
    ) -> bool:
        """Write the record's fields (making the object if new). `worker`: only while the
        response is active; False when it is not (cancelled or failed meanwhile: nothing
        written). `turn`: a response's own turn (its input and its reply, as the template
        reads them), kept in its chain once, after `parent`'s (chain.lua). `op`: the write's
        id, for a caller that retries it (a retry with the same id answers as its first run)."""
        kind = record.KIND
        pairs = [x for kv in record.to_fields().items() for x in kv]
        own = _json(turn) if turn is not None else ""
        args = [owner, ttl, "1" if worker else "0", op or new_op_id(), object_id, own, parent, *pairs]
        what, check = f"saving {kind} {object_id}", f"read the {kind}"
        raw = await self.connection.run("object_save", self._keys(kind, object_id), args, what, check)
        status = _text(fields(raw)["status"])
        if status == "missing":
            raise ObjectNotFound(kind, object_id)
        return status == "ok"

    async def read(self, record: type[R], object_id: str, owner: str, names: Iterable[str]) -> R:
        """The owner's object, its fields `names` read (an absent one: ''), or ObjectNotFound."""
        answer = fields(
            await self.connection.run("object_read", self._keys(record.KIND, object_id)[:1], [owner, *names])
        )
        if _text(answer.pop(".status")) != "ok":
            raise ObjectNotFound(record.KIND, object_id)
        return record.from_fields({k: _text(v) for k, v in answer.items()})

    async def base(
        self, response_id: str, owner: str, names: Iterable[str], frame: str
    ) -> tuple[ResponseRecord, Walk | None]:
        """A stored response as a continuation reads it (context.lua): its fields `names`,
        and, unless its state can be continued by a turn rendered alone under `frame` ('' :
        never), the conversation it ends, walked (`Walk`). ObjectNotFound if it is not the
        owner's."""
        keys = self.keys.response(response_id)
        tag = chain_of(response_id)
        base = keys[0][: len(keys[0]) - (len(response_id) - len(tag))]
        args = [owner, response_id, base, tag, frame, *names]
        answer = fields(await self.connection.run("context", keys, args))
        if _text(answer.pop(".status")) != "ok":
            raise ObjectNotFound("response", response_id)
        walked = _text(answer.pop(".walked"))
        walk = None
        if walked == "broken":
            walk = Walk([], "", "", broken=True)
        elif walked:
            turns = [json.loads(_text(t)) for t in answer.pop(".turns")]
            walk = Walk(turns, _text(answer.pop(".root")), _text(answer.pop(".first")))
        return ResponseRecord.from_fields({k: _text(v) for k, v in answer.items()}), walk

    async def delete(self, kind: ObjectKind, object_id: str, owner: str) -> str:
        """Delete the owner's object; returns the session that held its state ('' if none)."""
        what, check = f"deleting {kind} {object_id}", f"read the {kind} (not found: it was deleted)"
        args = [owner, new_op_id(), object_id]
        answer = fields(
            await self.connection.run("object_delete", self._keys(kind, object_id), args, what, check)
        )
        if _text(answer["status"]) != "ok":
            raise ObjectNotFound(kind, object_id)
        return _text(answer["session"])

    # -- a background response ----------------------------------------------------------------
    async def append_event(
        self,
        response_id: str,
        owner: str,
        event: str,
        lease_until: float,
        ttl: int,
        kind: str = "",
        op: str = "",
    ) -> bool:
        """Append an event of type `kind` ('' : only renew the lease); False once the
        response was stopped (cancelled, failed or deleted). `op`: as `save`'s."""
        args = [owner, event, f"{lease_until:.3f}", ttl, (op or new_op_id()) if event else "", kind]
        what, check = f"an event of response {response_id}", "read its events"
        answer = fields(
            await self.connection.run("response_event", self.keys.response(response_id), args, what, check)
        )
        return _text(answer["status"]) == "ok"

    async def events(
        self, response_id: str, owner: str, start: int, most: int
    ) -> tuple[bool, list[tuple[str, str]]]:
        """(whether it has ended, at most `most` of its events from sequence number
        `start`, each (its type, its JSON)), read together."""
        keys, args = self.keys.response(response_id), [owner, start, most]
        answer = fields(await self.connection.run("response_events", keys, args))
        if _text(answer["status"]) != "ok":
            raise ObjectNotFound("response", response_id)
        events = [(_text(t), _text(e)) for t, e in zip(answer["types"], answer["events"], strict=True)]
        return int(answer["ended"]) == 1, events

    async def wait_events(self, response_id: str, start: int, block: float) -> bool:
        """Wait up to `block` seconds for the event numbered `start` (or a later one) to
        come: whether it did (XREAD BLOCK; the caller reads it with `events`, which checks
        the owner)."""
        return await self.connection.wait(self.keys.response(response_id)[1], f"0-{start}", block)

    async def cancel(self, response_id: str, owner: str) -> tuple[str, ResponseRecord | None]:
        """Cancel an active background response: ('ok', its record), ('ended', its record)
        for one that had ended, ('foreground', None) for one that did not run in the
        background. The record: its `body`, `status` and `error`."""
        what, check = f"cancelling response {response_id}", "read the response (its status)"
        answer = fields(
            await self.connection.run(
                "response_cancel", self.keys.response(response_id), [owner], what, check
            )
        )
        status = _text(answer["status"])
        if status == "missing":
            raise ObjectNotFound("response", response_id)
        if status == "foreground":
            return status, None
        names = {"body": "body", "now": "status", "error": "error"}
        return status, ResponseRecord.from_fields({names[k]: _text(answer[k]) for k in names})

    async def expire(self, response_id: str, message: str, *, now: bool = False) -> Expired:
        """Fail the response if its worker's lease has lapsed (`now`: whatever its lease)."""
        args = [message, "1" if now else ""]
        what, check = f"failing response {response_id}", "read the response (its status)"
        keys = self.keys.response(response_id)
        answer = fields(await self.connection.run("response_expire", keys, args, what, check))
        return Expired(_text(answer["status"]), _text(answer["owner"]), _text(answer["orphan"]))

    async def lease(
        self, op: Literal["add", "drop", "due", "count"], response_id: str = "", until: float = 0
    ) -> tuple[list[str], int]:
        """The register of background responses in progress: add or drop one, or read
        those whose lease has lapsed; (due ids, how many are registered)."""
        args = [op, response_id, f"{until:.3f}"]
        answer = fields(await self.connection.run("leases", [self.keys.leases()], args))
        return [_text(i) for i in answer["ids"]], int(answer["count"])

    # -- a conversation's items -----------------------------------------------------------------
    async def add_items(
        self, conversation_id: str, owner: str, ttl: int, items: list[dict], after: int | None = None
    ) -> tuple[int, bool]:
        """Append items; (the count after, whether the list held other than `after` items
        before them: another writer's came first). `after` None: any."""
        expect = "" if after is None else str(after)
        args = [owner, ttl, new_op_id(), expect, *(_json(i) for i in items)]
        what, check = f"adding items to conversation {conversation_id}", "list its items"
        keys = self.keys.conversation(conversation_id)
        answer = fields(await self.connection.run("items_add", keys, args, what, check))
        if _text(answer["status"]) != "ok":
            raise ObjectNotFound("conversation", conversation_id)
        return int(answer["count"]), _text(answer["moved"]) == "1"

    async def items(
        self, conversation_id: str, owner: str, names: Iterable[str], frame: str = ""
    ) -> tuple[list[dict], ConversationRecord, int]:
        """A conversation's items, oldest first, and its fields `names`; with a `frame`, only
        those after the ones its state consumed if a turn rendered alone under that frame can
        continue it (items_read.lua). (The items, the record, the first item's index.)"""
        args = [owner, frame or "all", *names]
        answer = fields(
            await self.connection.run("items_read", self.keys.conversation(conversation_id), args)
        )
        if _text(answer.pop(".status")) != "ok":
            raise ObjectNotFound("conversation", conversation_id)
        items = [json.loads(_text(i)) for i in answer.pop("items")]
        first = int(answer.pop("from"))
        return items, ConversationRecord.from_fields({k: _text(v) for k, v in answer.items()}), first

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> None:
        answer = fields(
            await self.connection.run(
                "items_delete",
                self.keys.conversation(conversation_id),
                [owner, item_id, new_op_id()],
                f"deleting item {item_id} of conversation {conversation_id}",
                "list its items",
            )
        )
        status = _text(answer["status"])
        if status != "ok":
            raise ObjectNotFound("conversation" if status == "missing" else "item", item_id)
