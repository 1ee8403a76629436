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
    "response_expire", "leases", "items_add", "items_read", "items_delete",
    "unindex",
)  # fmt: skip


@functools.cache
def source(name: str) -> str:
    """The whole text of script `name`: its libraries, then its own body."""
    body = (LUA / f"{name}.lua").read_text()
    first = body.splitlines()[0] if body else ""
    libraries = first.removeprefix("--! uses:").split() if first.startswith("--! uses:") else []
    return "".join((LUA / f"{lib}.lua").read_text() + "\n" for lib in libraries) + body
