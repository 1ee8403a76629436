"""A stored response's and a conversation's records (app/store/records.py): each field is
written and read by its own name and type, and a body Python wrote comes back as written,
whatever a script did to the record since (a cancel sets the status, never re-encodes the
body: cjson would write an empty array as `{}`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets

import redis

from app.config import Settings
from app.store import ConversationRecord, ResponseRecord, Store

BODY = {
    "id": "resp_x", "object": "response", "status": "queued", "output": [], "tools": [],
    "metadata": {}, "usage": None, "text": {"format": {"type": "text"}},
}  # fmt: skip


def test_a_record_round_trips_through_its_fields():
    record = ResponseRecord(
        status="completed", body=BODY, error={"code": "c", "message": "m"}, context=[], input=[{"id": "m"}],
        session="s" * 32, version=3, n_tokens=17, tokens="h", digest="d", own=True, created_at=5, background=False,
        lease=1.5, run="", events_bytes=0, parent="resp_y", frame="f", closing="[1, 2]",
    )  # fmt: skip
    f = record.to_fields()
    assert set(f) == {x.name for x in dataclasses.fields(ResponseRecord)}  # (every field, by its name)
    assert all(isinstance(v, str) for v in f.values())
    assert ResponseRecord.from_fields(f) == record
    conversation = ConversationRecord(
        "s" * 32, 1, 2, frame="f", closing="[]", consumed=4, metadata={"k": "v"}, created_at=9
    )
    assert ConversationRecord.from_fields(conversation.to_fields()) == conversation


def test_a_write_names_only_what_it_sets():
    assert ResponseRecord(run="abc").to_fields() == {"run": "abc"}
    assert ConversationRecord(metadata={}).to_fields() == {"metadata": "{}"}
    # a field the script answered empty (absent in the hash) reads as absent
    absent = ResponseRecord.from_fields({"version": "", "body": "", "own": "", "tokens": ""})
    assert (absent.version, absent.body, absent.own, absent.tokens) == (None, None, False, "")


def test_a_cancelled_body_keeps_its_arrays(redis_url):
    """Cancel a queued background response: the body in Redis is byte for byte what Python
    wrote (its empty arrays stay `[]`), and the record reads it back with the cancel's status."""
    prefix = f"records-{secrets.token_hex(4)}:"

    async def go() -> tuple[str, ResponseRecord | None, ResponseRecord]:
        store = Store.from_settings(Settings(redis_url=redis_url, key_prefix=prefix))
        try:
            queued = ResponseRecord(status="queued", body=BODY, background=True, lease=1e12)
            assert await store.responses.save("resp_x", "owner", 60, queued)
            status, cancelled = await store.responses.cancel("resp_x", "owner")
            read = await store.responses.read(ResponseRecord, "resp_x", "owner", ResponseRecord.BODY)
            return status, cancelled, read
        finally:
            await store.close()

    status, cancelled, read = asyncio.run(go())
    written = json.dumps(BODY, separators=(",", ":"))
    stored = redis.Redis.from_url(redis_url).hget(f"{prefix}response:{{resp_x}}", "body")
    assert stored is not None and stored.decode() == written
    assert status == "ok" and cancelled is not None
    for record in (cancelled, read):
        assert record.response == {**BODY, "status": "cancelled"}
        assert record.response["output"] == [] and record.response["tools"] == []
