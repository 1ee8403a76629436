"""The writes: a session's whole transaction, from its lock to its commit.

Every write on a session (generate, score with `commit`, rollback) reads top to bottom
here; the writes that make one (create, import, fork) are making.py's:

  1. lock: take the session's writer lock in Redis (`SessionStore.begin`);
  2. start: find the starting state (reads.py: the hot copy Redis confirmed, or bytes);
  3. run: one engine `Request`, which carries the starting state in and the committed
     state, already encoded, out (the engine never calls back here);
  4. reserve: a commit that grows the session, within its tenant's quota and Redis's headroom
     (`Tenants.reserve_growth`);
  5. commit: write a delta or a snapshot (the persistence policy, `persist_for`), fenced on
     the version the lock was taken at, so a writer whose lease lapsed can never overwrite
     a newer commit; keep the committed state in the hot cache;
  6. settle: the tenant's ledger takes the session as the commit left it, and the prefix
     index its state (`Tenants.settle`: one round trip).

Whatever happens, the lock is released, and a request that did not reach step 5 changed
nothing (but for `on_disconnect: commit`, `Run.close`). A commit that keeps its session
for a holder (a stored response: `Run.keep_as`) leaves step 6 to it, which settles its
own record in the same round trip.

Persistence policy: a request that started from a stored snapshot commits only what
changed (a delta) while the stored snapshot and deltas with it stay within twice the
state's own size (`model.state.persist`); else it writes a fresh snapshot, which also
clears the deltas. Bytes written per request therefore grow with the new tokens (a state
that only grows is never rewritten whole), and a full read never reads more than about
twice the state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from app import prefixes
from app.engine import Finished, Logprobs, Request, Stored
from app.store import (
    SessionMeta,
    Writer,
)
from app.transcript import Segment
from model import State
from model.grammar import Matcher
from model.sampling import SamplingParams
from model.state import Persist

from .cache import Held
from .making import SessionMaking
from .reads import _stored
from .run import Run


@dataclass
class Generation:
    """What a generation samples, and how: the sampling controls, seed, limits and stop
    strings; with `commit_on_disconnect`, a stream cut short commits the tokens it sent;
    `logprobs` asks for alternatives and the prompt's log-probs (`Run.result`)."""

    params: SamplingParams
    max_tokens: int
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    commit_on_disconnect: bool = False
    logprobs: Logprobs = field(default_factory=Logprobs)
    started: float = field(default_factory=time.perf_counter)
    grammar: Matcher | None = None  # the output's grammar, compiled; each run samples under a copy


class SessionService(SessionMaking):
    """The sessions service: new sessions (`SessionMaking`), and the transactions on one."""

    async def retain(self, session_id: str, owner: str, ttl: int, holder: str = "") -> SessionMeta:
        """Give a session a new sliding TTL of `ttl` seconds, from now (held by `holder`, if
        given: `SessionStore.retain`); the ledger follows."""
        meta = await self.store.retain(session_id, owner, ttl, holder)
        return await self.tenants.settled(owner, meta, index=False)

    async def delete(self, session_id: str, expected: int | None, owner: str, holder: str = "") -> bool:
        """Delete a session; with `holder`, only once no other holder is left (whether it was
        deleted: `SessionStore.delete`)."""
        if not await self.store.delete(session_id, expected, owner, holder):
            return False
        self.cache.drop(session_id)
        await self.tenants.forgotten(owner, session_id)
        return True

    # -- transactions -------------------------------------------------------------------------
    async def score(
        self, session_id: str, ids: list[int], *, commit: bool, expected: int | None, owner: str
    ) -> tuple[SessionMeta, list[float | None]]:
        """Teacher-forced log-probs of `ids` continuing the session; with `commit`, the
        session goes on from after them."""
        if not commit:
            return await self.score_only(session_id, ids, expected, owner)
        writer, start = await self._begin(session_id, expected, owner)
        try:
            res = await self._finish(
                Request(start, ids, prompt_logprobs=True, persist=self.persist_for(writer.meta))
            )
            segment = Segment(session_id, writer.meta.version + 1, "score", writer.meta.n_tokens, ids)
            return await self.commit(writer, res, owner, segment), res.prompt_logprobs
        finally:
            await self.release(writer, owner)

    async def generate(
        self, session_id: str, ids: list[int], gen: Generation, *, expected: int | None, owner: str
    ) -> Run:
        """Take the lock, find the starting state and start generating; the caller owns the
        `Run` (stream or complete it, and always close it)."""
        writer, start = await self._begin(session_id, expected, owner)
        try:
            req = Request(
                start,
                ids,
                gen.params,
                gen.seed,
                gen.max_tokens,
                gen.stop,
                persist=self.persist_for(writer.meta),
            )
            req.prompt_logprobs, req.top_logprobs = gen.logprobs.prompt, gen.logprobs.top
            req.grammar = gen.grammar.fork() if gen.grammar is not None else None
            self._submit(req)
        except BaseException:
            await self.release(writer, owner)
            raise
        run = Run(self, req, writer, owner, ids, gen.started)
        run.commit_on_disconnect = gen.commit_on_disconnect
        return run

    async def rollback(self, session_id: str, version: int, expected: int | None, owner: str) -> SessionMeta:
        """Make a kept version's state current again, as a new version (fenced like every
        write): history only moves forward, and the versions rolled back over stay kept."""
        writer, _ = await self._begin(session_id, expected, owner)
        try:
            at = await self._read_version(session_id, version, None, owner)
            res = await self._finish(Request(_stored(at), [], persist=Persist(self.state_dtype)))
            segment = Segment(session_id, writer.meta.version + 1, "rollback", res.n_tokens, restores=version)
            return await self.commit(writer, res, owner, segment, at.tokens_hash)
        finally:
            await self.release(writer, owner)

    # -- the steps ------------------------------------------------------------------------------
    async def _begin(
        self, session_id: str, expected: int | None, owner: str
    ) -> tuple[Writer, State | Stored]:
        """1 and 2: the writer lock and the starting state. On any error the lock is released."""
        held = self.cache.get(session_id)
        writer = await self.store.begin(session_id, expected, held.commit_id if held else None, owner)
        try:
            return writer, self._start(writer.meta, writer.state, held)
        except BaseException:
            await self.release(writer, owner)
            raise

    def persist_for(self, meta: SessionMeta) -> Persist:
        """The persistence policy: how a commit on top of `meta` stores its new state."""
        if not self.delta_persistence or meta.snapshot_bytes == 0:
            return Persist(self.state_dtype)
        return Persist(
            self.state_dtype,
            since=meta.n_tokens,
            delta_budget=meta.snapshot_bytes - meta.delta_bytes,
            stored=meta.snapshot_bytes + meta.delta_bytes,
        )

    async def commit(
        self, writer: Writer, res: Finished, owner: str, segment: Segment, tokens_hash: str | None = None
    ) -> SessionMeta:
        """4, 5 and 6: reserve what the commit adds, commit the new state and its transcript
        segment fenced, keep it hot, and settle it with the tenant (its state indexed by its
        tokens, `tokens_hash`; default: the old state's, extended by the segment's ids)."""
        assert res.encoded is not None
        old = writer.meta
        packed = dataclasses.replace(segment, committed_at=time.time()).to_bytes()
        # at most what the session will hold (a replaced chain moves to the history, when kept)
        kept = old.state_bytes if res.encoded.kind == "delta" or old.keep_versions > 1 else 0
        await self.tenants.reserve_growth(
            owner, old, len(res.encoded.blob) + len(packed) + old.history_bytes + kept
        )
        if tokens_hash is None:
            tokens_hash = prefixes.extend(old.tokens_hash, segment.ids)
        blob = res.encoded.blob
        snapshot, delta = (blob, None) if res.encoded.kind == "snapshot" else (None, blob)
        meta = await writer.commit(
            res.n_tokens, snapshot=snapshot, delta=delta, segment=packed, tokens_hash=tokens_hash
        )
        self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.state))
        if writer.kept_as is not None:  # (its holder settles it, with its own record: `Run.keep_as`)
            return meta
        return await self.tenants.settled(owner, meta, index=self.prefix_reuse)

    async def release(self, writer: Writer, owner: str) -> None:
        """Give up a writer's lock. A writer that did not commit had still re-armed its
        session's expiry (`begin` does): the ledger follows. Shielded, as the release is: a
        request cancelled by its client's hang-up still completes both."""

        async def release() -> None:
            if await writer.release():
                await self.tenants.touch(owner, writer.meta)

        await asyncio.shield(release())
