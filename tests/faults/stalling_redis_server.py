"""`python -m app`, but a chosen script meets a stalled Redis: fault injection for the
tests only, so no setting or flag of the real server exposes it.

    python -m tests.faults.stalling_redis_server [recur serve flags...]

Before each script it runs, the server reads the key `STALL_KEY` in its Redis. When the
key names that script (`"NAME SECONDS"`), the server deletes the key, sends `DEBUG SLEEP
SECONDS` on a connection of its own, waits until Redis has taken it, and only then sends
the script: which reaches a Redis that answers nothing for SECONDS, and runs when the
stall ends, as a command queued behind a slow one does (tests/faults/test_stalled_writes.py).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import redis.asyncio as aioredis

from app.cli import main
from app.store import connection

STALL_KEY = "recur-test:stall"
ASLEEP = 0.05  # seconds for DEBUG SLEEP to reach Redis before the script is sent


def stall_on_demand() -> None:
    init, run = connection.Connection.__init__, connection.Connection.run
    sides: dict[int, aioredis.Redis] = {}

    def init_kept(self: connection.Connection, url: str, **kwargs: Any) -> None:
        init(self, url, **kwargs)
        sides[id(self)] = aioredis.Redis.from_url(url)  # no timeout: it waits out the stall

    async def stalled(self: connection.Connection, name: str, *args: Any) -> Any:
        side = sides[id(self)]
        rule = (await side.get(STALL_KEY) or b"").decode().split()
        if rule and rule[0] == name and await side.delete(STALL_KEY):
            asyncio.ensure_future(side.execute_command("DEBUG", "SLEEP", rule[1]))
            await asyncio.sleep(ASLEEP)
        return await run(self, name, *args)

    connection.Connection.__init__ = init_kept  # type: ignore[method-assign]
    connection.Connection.run = stalled  # type: ignore[method-assign]


if __name__ == "__main__":
    stall_on_demand()
    sys.exit(main(["serve", *sys.argv[1:]]))
