"""`python -m app`, but every writer stalls before its commit: fault injection for the
tests only, so no setting or flag of the real server exposes it.

    python -m tests.faults.stalled_server SECONDS [recur serve flags...]

Each writer stops renewing its lock (a stalled process renews nothing) and sleeps
SECONDS just before its commit script runs; with a lock lease shorter than that, another
writer can take the lapsed lock and commit first, and the version fence must then refuse
the stalled commit (tests/faults/test_replicas.py).
"""

from __future__ import annotations

import asyncio
import sys

from app import store
from app.cli import main


def stall_every_commit(seconds: float) -> None:
    commit = store.Writer.commit

    async def stalled(self: store.Writer, *args, **kwargs):
        self._renewer.cancel()
        await asyncio.sleep(seconds)
        return await commit(self, *args, **kwargs)

    store.Writer.commit = stalled  # type: ignore[method-assign]


if __name__ == "__main__":
    stall_every_commit(float(sys.argv[1]))
    sys.exit(main(["serve", *sys.argv[2:]]))
