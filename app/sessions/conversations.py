"""The Conversations API's transactions: a conversation is a session.

A conversation holds its items (app/store/responses.py) and names the session whose state
has consumed them, rendered through the chat template. Adding items prefills just them
(the session's stored tokens, by their chained hash, must be a prefix of the items'
rendering: app/prefixes.py); a response with `conversation` continues the session in
place and appends its input and output (responses.py). Deleting an item cannot un-consume
it: the next use finds the session's tokens no longer a prefix of the items' rendering,
and prefills the items whole in a new session, which replaces the old one.
"""

from __future__ import annotations

import time

from app import prefixes
from app.store import ConversationRecord, ObjectNotFound, ResponseStore, SessionNotFound, new_object_id

from .service import SessionService
from .starts import Render, messages


class Conversations:
    def __init__(self, service: SessionService, store: ResponseStore, retention: int):
        self.service = service
        self.store = store
        self.retention = retention

    async def create(
        self, owner: str, items: list[dict], metadata: dict | None, render: Render
    ) -> tuple[str, ConversationRecord]:
        """A new conversation holding `items` (each with an id), its session prefilled
        with them: its id and its record."""
        conversation_id = new_object_id("conv")
        meta = await self.service.create(render.new(render(messages(items), False)), self.retention, owner)
        record = ConversationRecord(
            meta.id, meta.version, meta.n_tokens, metadata=metadata or {}, created_at=int(time.time())
        )
        try:
            await self.service.tenants.reserve(
                owner, conversation_id, sum(map(len, record.to_fields().values())), self.retention
            )
            await self.store.save(conversation_id, owner, self.retention, record)
            await self.store.add_items(conversation_id, owner, self.retention, items)
        except BaseException:
            await self.service.delete(meta.id, None, owner)
            await self.service.tenants.forget(owner, conversation_id)
            raise
        return conversation_id, record

    async def get(self, owner: str, conversation_id: str) -> ConversationRecord:
        """A conversation's created_at and metadata."""
        return await self.store.read(ConversationRecord, conversation_id, owner, ["created_at", "metadata"])

    async def update(self, owner: str, conversation_id: str, metadata: dict) -> ConversationRecord:
        await self.get(owner, conversation_id)
        await self.store.save(conversation_id, owner, self.retention, ConversationRecord(metadata=metadata))
        return await self.get(owner, conversation_id)

    async def delete(self, owner: str, conversation_id: str) -> None:
        """Delete a conversation and its session: the session first, so that one a response
        is writing refuses the delete (SessionBusy) before anything is gone."""
        held = (await self.store.read(ConversationRecord, conversation_id, owner, ["session"])).session or ""
        await self._drop(owner, held)
        session = await self.store.delete("conversation", conversation_id, owner)
        await self.service.tenants.forgotten(owner, conversation_id)
        if session != held:  # (a response that ended meanwhile gave it a new one)
            await self._drop(owner, session)

    async def _drop(self, owner: str, session: str) -> None:
        if session:
            try:
                await self.service.delete(session, None, owner)
            except SessionNotFound:
                pass

    async def items(self, owner: str, conversation_id: str) -> list[dict]:
        return (await self.store.items(conversation_id, owner, []))[0]

    async def add(self, owner: str, conversation_id: str, new: list[dict], render: Render) -> None:
        """Append items: the conversation's session prefills just them (see the module)."""
        items, c, _ = await self.store.items(conversation_id, owner, ["session", "version", "n_tokens"])
        ids = render(messages([*items, *new]), False)
        tokens, n = self.service.with_bos(ids), c.n_tokens or 0
        held = prefixes.extend(prefixes.root(self.service.engine.fingerprint), tokens[:n])
        try:
            meta = await self.service.get(c.session or "", owner)
            same = n <= len(tokens) and meta.tokens_hash == held and meta.version == c.version
        except SessionNotFound:
            same = False
        if same and tokens[n:]:
            meta, _ = await self.service.score(
                meta.id, render.new(tokens[n:]), commit=True, expected=meta.version, owner=owner
            )
        elif not same:
            meta = await self.service.create(render.new(ids), self.retention, owner)
        await self.store.add_items(conversation_id, owner, self.retention, new)
        # (its state ends past the items' last turn stop: the next response renders them whole)
        state = ConversationRecord(
            session=meta.id, version=meta.version, n_tokens=meta.n_tokens, closing="", consumed=0
        )
        await self.store.save(conversation_id, owner, self.retention, state)
        if not same:
            await self._drop(owner, c.session or "")

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> None:
        await self.store.delete_item(conversation_id, owner, item_id)

    async def item(self, owner: str, conversation_id: str, item_id: str) -> dict:
        found = next((i for i in await self.items(owner, conversation_id) if i.get("id") == item_id), None)
        if found is None:
            raise ObjectNotFound("item", item_id)
        return found
