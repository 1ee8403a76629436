"""The Lua scripts, one `.lua` file each under app/store/lua/, registered once.

A script's first line may name the libraries it uses (`--! uses: now session`): files of
shared functions, prepended in that order. Every script answers field/value pairs (or a
plain integer, or false), which `app.store.types.fields` reads by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

LUA = Path(__file__).with_name("lua")
SCRIPTS = (
    "create", "read", "begin", "commit", "renew", "release", "delete", "read_at", "versions",
    "record", "settle", "forget", "usage", "listing", "find_prefix", "bucket",
    "object_save", "object_read", "object_delete", "response_event", "response_events", "response_cancel",
    "response_expire", "leases", "items_add", "items_read", "items_delete", "context",
    "unindex", "retain", "hold", "fork",
)  # fmt: skip

# The writes whose effect a request's answer reports. One that was sent and got no answer
# (a timeout, a lost connection) may still have run, so it is never reported as failed:
# `Connection.run` raises OutcomeUnknown. The client's retry (a lost connection only,
# never a timeout: a timed-out command may still be queued in Redis and run after the
# retry) is safe for these because each recognises its own first run: a commit or create
# by its commit id (a fork too), a begin or delete by its lock token. The other scripts read, or write
# what the next write of the same kind overwrites (the ledger, leases, the lock's lease).
WRITES = frozenset(
    {
        "create", "fork", "commit", "delete", "object_save", "object_delete", "items_add", "items_delete",
        "response_cancel", "response_event", "response_expire",
    }
)  # fmt: skip


@functools.cache
def source(name: str) -> str:
    """The whole text of script `name`: its libraries, then its own body."""
    body = (LUA / f"{name}.lua").read_text()
    first = body.splitlines()[0] if body else ""
    libraries = first.removeprefix("--! uses:").split() if first.startswith("--! uses:") else []
    return "".join((LUA / f"{lib}.lua").read_text() + "\n" for lib in libraries) + body
