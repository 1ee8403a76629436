"""What every request on a session shares, and the requests that only read one.

`SessionReads` holds the service's parts (the store's session room, the tenants room, the
engine, the hot cache) and the steps every request takes: find the starting state (this
replica's hot copy when Redis confirms, in the same round trip, that it is the current
commit, else the bytes Redis returned) and run one engine `Request` on it. Reads take no
lock; each one that re-arms a session's expiry lets the tenant's ledger follow
(`Tenants.touch`). The writes are `SessionService`'s (service.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app import metrics
from app.engine import Engine, EngineError, Finished, Request, Stored
from app.store import AtVersion, SessionMeta, SessionStore, StateBlobs, Version, VersionMismatch
from app.tenants import CLIENT, Tenants
from app.transcript import Segment, lineage
from model import State
from model.state import Persist

from .cache import Held, HotCache

log = logging.getLogger("recur.sessions")


# a listed session's preview: the ids of its transcript's first segments, at most
# PREVIEW_TOKENS of them (the API decodes and clips them)
PREVIEW_SEGMENTS = 4
PREVIEW_TOKENS = 128


@dataclass
class Listed:
    """One session of a listing: its metadata, whether it is ephemeral, and the first ids it
    consumed (BOS included, if the model has one)."""

    meta: SessionMeta
    ephemeral: bool
    head: list[int]


@dataclass
class Listing:
    sessions: list[Listed]
    cursor: str  # the next page's ('' when there is none)


def _head_ids(segments: list[bytes]) -> list[int]:
    ids: list[int] = []
    for blob in segments:
        ids += Segment.from_bytes(blob).ids
        if len(ids) >= PREVIEW_TOKENS:
            break
    return ids[:PREVIEW_TOKENS]


class ModelMismatch(Exception):
    """The session's state belongs to another model than the one this server runs."""


class SessionReads:
    def __init__(self, store: SessionStore, tenants: Tenants, engine: Engine, cache: HotCache):
        self.store = store
        self.tenants = tenants
        self.engine = engine
        self.cache = cache

    # -- reads --------------------------------------------------------------------------------
    async def get(self, session_id: str, owner: str) -> SessionMeta:
        meta, _ = await self.store.read(session_id, owner=owner)
        await self.tenants.touch(owner, meta)
        return meta

    async def listing(self, owner: str, cursor: str, count: int, ephemeral: bool = False) -> Listing:
        """A page of the caller's own sessions, newest first (the ephemeral ones, made for
        one request, only with `ephemeral`), each with the start of what it consumed, and the
        next page's cursor ('': no more). (A session that expired or was deleted since its
        ledger entry was read is left out.)"""
        page, after = await self.tenants.listing(owner, cursor, count, ephemeral)
        found = await self.store.peek([sid for sid, _ in page], owner, head=PREVIEW_SEGMENTS)
        hidden = dict(page)
        entries = [Listed(meta, hidden[meta.id], _head_ids(segments)) for meta, segments in found]
        return Listing(entries, after)

    async def versions(self, session_id: str, owner: str) -> tuple[SessionMeta, list[Version]]:
        """The session and the versions it keeps (oldest first)."""
        meta, kept = await self.store.versions(session_id, owner)
        await self.tenants.touch(owner, meta)
        return meta, kept

    async def transcript(
        self, session_id: str, owner: str, since_version: int | None = None
    ) -> tuple[SessionMeta, list[Segment], bool]:
        """The segments the current state consumed, in order (only the session's own
        versions after `since_version`, when given), and whether that history is complete."""
        at = await self.store.read_at(session_id, None, owner, transcript=True)
        assert at.transcript is not None
        await self.tenants.touch(owner, at.meta)
        segments, complete = lineage(
            [Segment.from_bytes(b) for b in at.transcript], session_id, at.meta.version
        )
        if since_version is not None:
            segments = [g for g in segments if g.session_id == session_id and g.version > since_version]
        return at.meta, segments, complete and not at.trimmed

    async def export(
        self, session_id: str, owner: str, dtype: str, expected: int | None, version: int | None = None
    ) -> tuple[SessionMeta, int, bytes]:
        """The committed state (or a kept `version`'s) as one snapshot in `dtype`: the state
        format itself (safetensors plus its JSON header with the model's fingerprint and a
        checksum). Returns the session, the version exported, and the bytes."""
        if version is not None:
            at = await self._read_version(session_id, version, expected, owner)
            res = await self._finish(Request(_stored(at), [], persist=Persist(dtype)))
            assert res.encoded is not None
            return at.meta, version, res.encoded.blob
        meta, start = await self._read(session_id, expected, owner)
        res = await self._finish(Request(start, [], persist=Persist(dtype)))
        self._cache_loaded(meta, res)
        await self.tenants.touch(owner, meta)
        assert res.encoded is not None
        return meta, meta.version, res.encoded.blob

    async def score_only(
        self, session_id: str, ids: list[int], expected: int | None, owner: str
    ) -> tuple[SessionMeta, list[float | None]]:
        """Teacher-forced log-probs of `ids` continuing the session, which stays as it is."""
        meta, start = await self._read(session_id, expected, owner)
        res = await self._finish(Request(start, ids, prompt_logprobs=True))
        self._cache_loaded(meta, res)
        await self.tenants.touch(owner, meta)
        return meta, res.prompt_logprobs

    # -- the steps every request shares -------------------------------------------------------
    async def _read(
        self, session_id: str, expected: int | None, owner: str
    ) -> tuple[SessionMeta, State | Stored]:
        """The current state, without the lock (a read-only request)."""
        held = self.cache.get(session_id)
        meta, blobs = await self.store.read(
            session_id, with_state=True, held_commit=held.commit_id if held else None, owner=owner
        )
        if expected is not None and meta.version != expected:
            raise VersionMismatch(session_id, expected, meta.version)
        return meta, self._start(meta, blobs, held)

    async def _read_version(
        self, session_id: str, version: int, expected: int | None, owner: str
    ) -> AtVersion:
        at = await self.store.read_at(session_id, version, owner, state=True)
        await self.tenants.touch(owner, at.meta)
        if expected is not None and at.meta.version != expected:
            raise VersionMismatch(session_id, expected, at.meta.version)
        self._same_model(at.meta)
        return at

    def _start(self, meta: SessionMeta, blobs: StateBlobs | None, held: Held | None) -> State | Stored:
        """The starting state of a request on `meta`: the bytes Redis returned or, when it
        returned none because `held` is the current commit, the held state."""
        self._same_model(meta)
        if blobs is not None:
            metrics.HOT_CACHE_MISSES.inc()
            return Stored(blobs.snapshot, blobs.deltas, meta.n_tokens)
        if held is None or held.commit_id != meta.commit_id:
            raise EngineError(f"session {meta.id}: Redis sent no state and the current one is not held")
        metrics.HOT_CACHE_HITS.inc()
        return held.state

    def _same_model(self, meta: SessionMeta) -> None:
        if meta.fingerprint != self.engine.fingerprint:
            raise ModelMismatch(
                f"session {meta.id} belongs to model {meta.model!r} ({meta.fingerprint}); "
                f"this server runs {self.engine.name!r} ({self.engine.fingerprint})"
            )

    def _submit(self, req: Request) -> Request:
        """Queue `req` with the engine, as its client's (the scheduler shares it out by client)."""
        req.client = CLIENT.get()
        return self.engine.submit(req)

    async def _finish(self, req: Request) -> Finished:
        """Run `req` to its end, for a request whose tokens nobody streams."""
        return await self._submit(req).finished()

    def _cache_loaded(self, meta: SessionMeta, res: Finished) -> None:
        """A read-only request loaded the current state from bytes: keep it hot."""
        if res.loaded is not None:
            self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.loaded))


def _stored(at: AtVersion) -> Stored:
    assert at.state is not None
    return Stored(at.state.snapshot, at.state.deltas, at.version.n_tokens)
