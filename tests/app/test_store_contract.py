"""What the store promises the service, against a real Redis: the Lua scripts and Python
name a session's fields the same way, and a streamed generate on an existing session
costs at most three Redis round trips with the default settings (begin, commit, and one
settlement of the tenant's ledger and prefix index)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading

import redis

from app.config import Settings
from app.store import SessionMeta, StateBlobs, Store
from app.store.types import fields

from .sse_client import generate


def test_lua_meta_fields_are_session_meta_fields(redis_url):
    """Every script's `meta()` answers exactly SessionMeta's fields (but the id, which the
    caller knows), by name: adding a field on one side alone fails here."""

    async def go() -> list[str]:
        store = Store.from_settings(
            Settings(redis_url=redis_url, key_prefix=f"contract-{secrets.token_hex(4)}:")
        )
        meta = await store.sessions.create(StateBlobs(b"s"), 1, "m", "fp", ttl=60)
        raw = await store.connection.run("read", store.sessions.keys.of_session(meta.id), ["0", "", "", "0"])
        await store.close()
        return list(fields(fields(raw)["meta"]))

    names = asyncio.run(go())
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(SessionMeta) if f.name != "id")
    assert len(names) == len(set(names))


class Monitor:
    """The commands Redis receives from clients (not those its scripts run) that name a
    key under `prefix`, from `start` until `stop`."""

    def __init__(self, url: str, prefix: str):
        self.url, self.prefix = url, prefix
        self.seen: list[str] = []
        self._marker = f"monitor-end-{secrets.token_hex(4)}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> list[str]:
        redis.Redis.from_url(self.url).echo(self._marker)
        self._thread.join(10)
        assert not self._thread.is_alive()
        return self.seen

    def _watch(self) -> None:
        with redis.Redis.from_url(self.url).monitor() as m:
            redis.Redis.from_url(self.url).echo("monitor-start")
            for cmd in m.listen():
                text = cmd["command"]
                if "monitor-start" in text:
                    self._ready.set()
                elif self._marker in text:
                    return
                elif cmd.get("client_type") != "lua" and self.prefix in text:
                    self.seen.append(text.split(" ")[0].upper())


def test_a_streamed_generate_makes_three_round_trips(server, http, redis_url):
    """Create, then a streamed generate: the begin script, the commit script and the
    tenant's settlement, and nothing else (the storage guard reads Redis's memory in the
    background, never per request)."""
    sid = http.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    generate(http, sid, max_tokens=4, temperature=0)  # (a warm hot cache, as a busy server has)
    monitor = Monitor(redis_url, str(server.settings["key_prefix"])).start()
    tokens, last, _ = generate(http, sid, max_tokens=6, temperature=0)
    seen = monitor.stop()
    assert last == "done" and tokens
    assert len(seen) <= 3, seen
    assert all(c in ("EVALSHA", "EVAL") for c in seen), seen
