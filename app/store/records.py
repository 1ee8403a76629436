"""A stored response's and a conversation's records, typed where they are made.

Each record is a dataclass whose field names are the hash's field names (app/store/keys.py
documents them): `to_fields` is what a write sets (a field left None is not written, so a
write names only what it changes) and `from_fields` reads the fields a script answered, by
name (a field not asked for stays None). A value is text in Redis: an int or a float as
its digits, a flag as '1' or '', a list or a dict as JSON that Python writes and reads, and
that a script never re-encodes (it sets `status` and `error` fields of their own). So a
new field is one edit here. Values only: no Redis here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

ObjectKind = Literal["response", "conversation"]
R = TypeVar("R", bound="Record")


def _encode(kind: str, value: Any) -> str:
    if kind == "json":
        return json.dumps(value, separators=(",", ":"))
    if kind == "bool":
        return "1" if value else ""
    if kind == "float":
        return f"{value:.3f}"
    return str(value)


def _decode(kind: str, text: str) -> Any:
    if kind == "str":
        return text
    if kind == "bool":
        return text == "1"
    if not text:  # (absent)
        return None
    if kind == "int":
        return int(text)
    return float(text) if kind == "float" else json.loads(text)


class Record:
    """What both records share: their hash's fields, each coded by its annotation."""

    KIND: ClassVar[ObjectKind]

    @classmethod
    @functools.cache
    def _kinds(cls) -> dict[str, str]:
        # "int | None" -> int; "list[dict] | None" -> json (read once per class)
        names = {"str", "int", "float", "bool"}
        out = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            base = str(f.type).split("|")[0].strip()
            out[f.name] = base if base in names else "json"
        return out

    def to_fields(self) -> dict[str, str]:
        """The hash's fields a write of this record sets (those not None)."""
        kinds = self._kinds()
        values = ((name, getattr(self, name)) for name in kinds)
        return {name: _encode(kinds[name], v) for name, v in values if v is not None}

    @classmethod
    def from_fields(cls: type[R], given: dict[str, str]) -> R:
        """The record from the fields a script answered (its other fields None)."""
        kinds = cls._kinds()
        return cls(**{name: _decode(kinds[name], text) for name, text in given.items() if name in kinds})


@dataclass(frozen=True)
class ResponseRecord(Record):
    """A response of the Responses API, as its hash `response:{R}` holds it."""

    KIND: ClassVar[ObjectKind] = "response"
    BODY: ClassVar[tuple[str, ...]] = ("body", "status", "error")  # the fields `response` reads

    status: str | None = None  # what the body says, or a script's later word (a cancel, a sweep)
    body: dict[str, Any] | None = None  # the Response object as the API returns it
    error: dict[str, Any] | None = None  # the error a script failed it with
    context: list[dict[str, Any]] | None = None  # (stored before chains) the conversation it ends
    parent: str | None = None  # the response it continues ('' none, 'conv_…' a conversation's items)
    frame: str | None = None  # the digest of what its conversation was rendered under
    closing: str | None = None  # the ids (JSON) that close its reply after its state, where known ('' not)
    input: list[dict[str, Any]] | None = None  # its own input items
    session: str | None = None  # the session holding the state it committed
    version: int | None = None  # that session's version
    n_tokens: int | None = None  # the tokens that state consumed
    tokens: str | None = None  # their hash (app/prefixes.py; '' unknown)
    digest: str | None = None  # their one-pass digest (`prefixes.digest`), for the next turn's check
    own: bool | None = None  # the response holds that session (deleting it lets go)
    created_at: int | None = None
    background: bool | None = None
    lease: float | None = None  # a background response's worker's lease end (unix s)
    run: str | None = None  # the session a background response's run made
    events_bytes: int | None = None  # its events' bytes (a script counts them)

    @property
    def response(self) -> dict[str, Any]:
        """The Response object: its body as Python wrote it, with the `status` and the
        `error` a script may have set since (a cancel, a sweep's failure) laid over it."""
        body = dict(self.body or {})
        if self.status:
            body["status"] = self.status
        if self.error:
            body["error"] = self.error
        return body


@dataclass(frozen=True)
class ConversationRecord(Record):
    """A conversation of the Conversations API, as its hash `conversation:{C}` holds it
    (its items are a list of their own)."""

    KIND: ClassVar[ObjectKind] = "conversation"

    session: str | None = None  # the session whose state consumed its items
    version: int | None = None  # that session's version
    n_tokens: int | None = None  # the tokens that state consumed
    tokens: str | None = None  # their hash (app/prefixes.py; '' unknown)
    digest: str | None = None  # their one-pass digest (`prefixes.digest`), for the next turn's check
    frame: str | None = None  # as a response's
    closing: str | None = None  # as a response's
    consumed: int | None = None  # how many of its items that state consumed
    metadata: dict[str, str] | None = None
    created_at: int | None = None
