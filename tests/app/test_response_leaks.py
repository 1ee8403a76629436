"""No response leaves a session that nothing references (issue 39, item 3): cancelled and
deleted background responses, a conversation deleted while a response writes it, and a
replica killed mid-response. Each test counts what Redis holds afterwards: every session
is one a stored response or a conversation names, or (a stored streamed response whose
replica died) one that lives no longer than a stateless session."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
import redis

from app.store import owner_of, tenant_of
from tests.conftest import ServerProcess

KEY = "leaks-key"
LONG = {"max_output_tokens": 1000, "extra_body": {"min_tokens": 1000}}  # (never ends before its stop)
STATELESS_TTL = 600


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        "shakespeare", tmp_path_factory.mktemp("leaks"), redis_url, cpu_threads=1, max_tokens=1000,
        api_keys=KEY, response_lease_seconds=3, lock_lease_seconds=3,
        stateless_session_ttl=STATELESS_TTL,
    ) as srv:  # fmt: skip
        yield srv


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def unreferenced(server: ServerProcess) -> dict[str, int]:
    """The sessions Redis holds that no response or conversation names, each with its TTL
    (s). A session's other keys without their session count too (TTL -3): a lock is left
    out only as a deleted session's one-minute tombstone (app/store/lua/delete.lua)."""
    r = redis.Redis.from_url(server.redis_url)
    p = server.settings["key_prefix"]
    named = set()
    for kind in ("response", "conversation"):
        for key in r.scan_iter(match=f"{p}{kind}:*"):
            if session := r.hget(key, "session"):
                named.add(session.decode())
    out = {}
    for key in r.scan_iter(match=f"{p}session:*"):
        sid = key.decode().split("{")[1].rstrip("}")
        if sid not in named:
            out[sid] = r.ttl(key)
    for part in ("deltas", "history", "transcript", "lock"):
        for key in r.scan_iter(match=f"{p}{part}:*"):
            sid = key.decode().split("{")[1].rstrip("}")
            alone = not r.exists(f"{p}session:{{{sid}}}")
            if alone and not (part == "lock" and 0 < r.pttl(key) <= 60_000):
                out[sid] = -3
    return out


def settle(server: ServerProcess, until: float = 30) -> dict[str, int]:
    """`unreferenced` once it holds nothing, or as it is after `until` seconds."""
    deadline = time.monotonic() + until
    while (left := unreferenced(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def running(oa: openai.OpenAI, **request: object) -> str:
    """A background response, once its worker has begun writing its events."""
    r = oa.responses.create(input="Tell a long tale.", background=True, **{**LONG, **request})  # type: ignore[call-overload]
    with oa.responses.retrieve(r.id, stream=True) as events:
        next(iter(events))
    return r.id


def test_cancelled_and_deleted_background_responses_leave_no_session(server):
    """40 background responses, each stopped while it runs: 20 cancelled, 20 deleted. Every
    session they made is gone, a cancelled one's replay ends with OpenAI's `error` event, and
    its record and events are in its key's ledger."""
    oa = client(server)
    r = redis.Redis.from_url(server.redis_url)
    cancelled = []
    for i in range(40):
        rid = running(oa)
        if i % 2:
            oa.responses.delete(rid)
        else:
            assert oa.responses.cancel(rid).status == "cancelled"
            cancelled.append(rid)
    assert settle(server) == {}
    p = server.settings["key_prefix"]
    assert not list(r.scan_iter(match=f"{p}session:*"))  # (none completed: none keeps a state)
    ledger = f"{p}tenant:{{{tenant_of(owner_of(KEY))}}}:bytes"
    for rid in cancelled:
        last = list(oa.responses.retrieve(rid, stream=True))[-1]
        assert last.type == "error" and last.code == "cancelled"
        events_bytes = int(r.hget(f"{p}response:{{{rid}}}", "events_bytes"))
        assert int(r.hget(ledger, rid) or 0) > events_bytes > 0
    assert "could not delete session" not in server.log.read_text()


def test_a_conversation_deleted_while_a_response_writes_it_is_refused_whole(server):
    """409 session_busy, and nothing is deleted: the conversation and its session stay
    (6 of 6 orphaned before); once the response has ended, the delete takes both."""
    oa = client(server)
    for _ in range(3):
        conv = oa.conversations.create(items=[{"role": "user", "content": "Hark."}])
        with oa.responses.create(conversation=conv.id, input="Speak.", stream=True, max_output_tokens=190,
                                 extra_body={"min_tokens": 190}) as s:  # fmt: skip
            next(iter(s))
            with pytest.raises(openai.ConflictError) as refused:
                oa.conversations.delete(conv.id)
            assert refused.value.body["type"] == "session_busy"
            assert oa.conversations.retrieve(conv.id).id == conv.id
            list(s)
        assert settle(server) == {}
        oa.conversations.delete(conv.id)
    assert settle(server) == {}


def test_a_replica_killed_mid_response_leaves_no_session(server, redis_url, tmp_path_factory):
    """SIGKILL a replica running a background response and a stored streamed one: the
    survivor's sweep fails the background response and deletes its session (once the dead
    worker's lock lapses); the streamed one's session lives no longer than a stateless
    session (it was made with that TTL, and only a kept response extends it)."""
    doomed = ServerProcess(
        "shakespeare", tmp_path_factory.mktemp("doomed"), redis_url, cpu_threads=1, max_tokens=1000,
        api_keys=KEY, response_lease_seconds=3, lock_lease_seconds=3,
        stateless_session_ttl=STATELESS_TTL, key_prefix=server.settings["key_prefix"],
    ).start()  # fmt: skip
    try:
        oa = client(doomed)
        before = set(unreferenced(server))
        rid = running(oa)
        stream = oa.responses.create(input="Another tale.", stream=True, max_output_tokens=1000,
                                     extra_body={"min_tokens": 1000})  # fmt: skip
        next(iter(stream))
        assert len(set(unreferenced(server)) - before) == 2
        doomed.kill()
    finally:
        doomed.stop()
    survivor = client(server)
    deadline = time.monotonic() + 30
    while survivor.responses.retrieve(rid).status != "failed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert survivor.responses.retrieve(rid).status == "failed"
    deadline = time.monotonic() + 30
    while len(left := unreferenced(server)) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(left) == 1, left  # the streamed response's, alone
    assert all(0 < ttl <= STATELESS_TTL for ttl in left.values()), left
