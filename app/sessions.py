"""The sessions service: a session's whole transaction, from its lock to its commit.

Every write (create, generate, score with `commit`) reads top to bottom here:

  1. lock: take the session's writer lock in Redis (`SessionStore.begin`);
  2. start: find the starting state: this replica's hot copy when Redis confirms, in the
     same round trip, that it is the current commit (then no state bytes travel), else
     the bytes Redis returned, for the engine to load;
  3. run: one engine `Request`, which carries the starting state in and the committed
     state, already encoded, out (the engine never calls back here);
  4. commit: record the session's new size in its tenant's quota ledger (refused past
     the tenant's limits or Redis's room), then write a delta or a snapshot (the
     persistence policy, `persist_for`), fenced on the version the lock was taken at, so
     a writer whose lease lapsed can never overwrite a newer commit;
  5. remember: keep the committed state in the hot cache.

Whatever happens, the lock is released, and a request that did not reach step 4 changed
nothing (but for `on_disconnect: commit`, `Run.close`). Reads (score without `commit`,
export) take no lock: the same steps without 1 and 4. Creates, forks and imports reserve
their place in the tenant's quota before any model time is spent.

Persistence policy: a request that started from a stored snapshot commits only what
changed (a delta) unless the deltas stored since the snapshot would then outweigh the
snapshot itself; then it writes a fresh snapshot, which also clears the deltas. Bytes
written per request therefore grow with the new tokens, and a full read never merges
more than about one snapshot's worth of deltas.

The hot cache keeps recently used states on the device, LRU within a byte budget. It is
only a shortcut: Redis holds the truth, a cached state is used only after Redis has
confirmed its commit id (random, never reused, unlike version numbers), and an entry is
replaced only after its session's commit succeeded, so it never holds an uncommitted
state.

This module knows neither HTTP nor tensors: routers translate its results, the engine
runs the model, the store speaks to Redis.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, TypeVar

from app import logs, metrics, prefixes
from app.config import Limits, Settings
from app.engine import (
    Engine,
    EngineError,
    Fairness,
    Finished,
    FinishReason,
    Logprobs,
    QueueFull,
    Request,
    Stored,
    TokenEvent,
)
from app.store import (
    AtVersion,
    QuotaExceeded,
    SessionMeta,
    SessionNotFound,
    SessionStore,
    StateBlobs,
    StorageFull,
    StoreUnavailable,
    Usage,
    Version,
    VersionGone,
    VersionMismatch,
    Writer,
    new_session_id,
    owner_of,
    tenant_of,
)
from app.transcript import Kind, Segment, lineage
from model import LanguageModel, State, StateError
from model.sampling import SamplingParams
from model.state import Persist, peek

T = TypeVar("T")
log = logging.getLogger("recur.sessions")

# The client a request serves, for the engine's fairness and the stream limit: its API key's
# owner, or (without keys, where every client is one tenant) its address. Set by the API
# for each request (`app.api.deps.bind_client`), as the log context is.
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("recur_client", default="")


class ModelMismatch(Exception):
    """The session's state belongs to another model than the one this server runs."""


class StateRejected(Exception):
    """A state offered for import that this server cannot take: damaged, or another model's."""


class ClientDisconnected(Exception):
    """The client hung up before the commit: nothing was committed."""


# -- the hot cache -------------------------------------------------------------------------------
class Held(NamedTuple):
    """A cached state and the commit that wrote it."""

    version: int
    commit_id: str
    state: State


class HotCache:
    """Session states by id, least recently used first out, within `max_bytes`. Read and
    written from the event loop only, but sized from the metrics thread: every access
    takes the lock."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Held, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> Held | None:
        """The cached state of a session, marking it recently used."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return None
            self._entries.move_to_end(session_id)
            return entry[0]

    def put(self, session_id: str, held: Held) -> None:
        size = held.state.nbytes()
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                if old[0].version > held.version:  # keep the newer of two racing puts
                    self._entries[session_id] = old
                    return
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[session_id] = (held, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def drop(self, session_id: str) -> None:
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                self._bytes -= old[1]


# -- the service ---------------------------------------------------------------------------------
class Sessions:
    def __init__(
        self,
        store: SessionStore,
        engine: Engine,
        *,
        hot_cache_bytes: int,
        state_dtype: str,
        delta_persistence: bool,
        limits: Limits,
        tenants: dict[str, Limits],
        storage_guard: float,
        history_versions: int,
        prefix_reuse: bool,
        stateless_ttl: int,
        import_limit: int,
        max_imports: int,
        max_streams: int,
    ):
        self.store = store
        self.max_streams = max_streams  # generations one client may run at once on this replica
        self._streams: collections.Counter[str] = collections.Counter()
        self.import_limit = import_limit  # bytes: the largest state a client may import
        self.max_imports = max_imports  # imports in progress at once on this replica
        self._imports = 0
        self.history_versions = history_versions  # kept versions of a session that asks for no number
        self.prefix_reuse = prefix_reuse
        self.stateless_ttl = stateless_ttl
        self.engine = engine
        self.cache = HotCache(hot_cache_bytes)
        self.state_dtype = state_dtype
        self.delta_persistence = delta_persistence
        self.limits = limits  # the quota of every tenant but those in `tenants` (by owner)
        self.tenants = tenants
        self.storage_guard = storage_guard

    # -- quotas ----------------------------------------------------------------------------------
    def limits_for(self, owner: str) -> Limits:
        return self.tenants.get(owner, self.limits)

    async def admit(self, owner: str) -> None:
        """The tenant's request rate, shared by all replicas: QuotaExceeded past it. Every
        /v1 request passes here first."""
        metrics.TENANT_REQUESTS.labels(tenant_of(owner)).inc()
        await self._quota(owner, self.store.admit(owner, self.limits_for(owner)))

    @contextlib.asynccontextmanager
    async def starting(self, owner: str, runs: int, max_tokens: int) -> AsyncIterator[Callable[[Run], None]]:
        """Admit a request that starts `runs` generations of up to `max_tokens` each: a place
        for each among its client's streams on this replica (QuotaExceeded past
        `max_streams`, before any work), and their tokens reserved in the tenant's bucket
        (QuotaExceeded while it is in debt, so concurrent requests cannot overdraw it). If
        starting them fails, both are given back. Yields `admitted`, to call on each run
        once all have started: each then gives back its place, and the tokens it did not
        draw, when it ends (`Run.close`)."""
        client = CLIENT.get()
        if self._streams[client] + runs > self.max_streams:
            raise QuotaExceeded(
                "streams",
                f"this client runs {self._streams[client]} generations on this server, its limit of "
                f"{self.max_streams}; retry when one has ended",
                1,
            )
        limits = self.limits_for(owner)
        self._streams[client] += runs
        try:
            await self._quota(owner, self.store.reserve_tokens(owner, limits, runs * max_tokens))
            try:
                yield lambda run: run.admitted(client, max_tokens)
            except BaseException:
                with contextlib.suppress(StoreUnavailable):  # (lost, the tokens only stay reserved)
                    await self.store.refund_tokens(owner, limits, runs * max_tokens)
                raise
        except BaseException:
            self._streams[client] -= runs
            raise

    async def ended(self, run: Run) -> None:
        """A generation admitted by `starting` has ended: its place among its client's
        streams is free, its tokens count against its tenant, and what it reserved and did
        not draw goes back."""
        if run.client is not None:
            self._streams[run.client] -= 1
            if not self._streams[run.client]:
                del self._streams[run.client]
        used = len(run.tokens)
        metrics.TENANT_GENERATED_TOKENS.labels(tenant_of(run.owner)).inc(used)
        await self.store.refund_tokens(run.owner, self.limits_for(run.owner), run.reserved - used)

    async def usage(self, owner: str) -> Usage:
        return self._seen(owner, await self.store.usage(owner))

    async def _reserve(self, owner: str, session_id: str, state_bytes: int, ttl: float, grows: bool) -> None:
        """Enter a session's size in its tenant's ledger before writing it: if it `grows`,
        only within the tenant's limits and Redis's room (QuotaExceeded, StorageFull)."""
        if grows and await self.store.storage_full(self.storage_guard):
            raise StorageFull("Redis is nearly full: new sessions and growing ones wait until it has room")
        limits = self.limits_for(owner) if grows else None
        record = self.store.record(owner, session_id, state_bytes, time.time() + ttl, limits)
        self._seen(owner, await self._quota(owner, record))

    async def _touch(self, meta: SessionMeta, owner: str) -> None:
        """Every use of a session re-arms its expiry (each script that reads or writes it):
        the ledger then takes that expiry, as Redis set it, and the session's size. Called
        after every script that re-arms a session, so the ledger forgets a session only when
        Redis does. Best effort: a read never fails for the ledger (in a Cluster it lives on
        another primary than the session); a replica that dies, or a tenant's primary that
        does not answer, between the two leaves the previous expiry until the next use."""
        try:
            self._seen(
                owner, await self.store.record(owner, meta.id, meta.stored_bytes, meta.expires_at, None)
            )
        except StoreUnavailable:
            log.warning("could not record a use of session %s in its tenant's ledger", meta.id)

    async def _quota(self, owner: str, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except QuotaExceeded as exc:
            metrics.QUOTA_REFUSALS.labels(tenant_of(owner), exc.limit).inc()
            raise

    @staticmethod
    def _seen(owner: str, usage: Usage) -> Usage:
        tenant = tenant_of(owner)
        metrics.TENANT_SESSIONS.labels(tenant).set(usage.sessions)
        metrics.TENANT_STATE_BYTES.labels(tenant).set(usage.state_bytes)
        return usage

    # -- metadata only -------------------------------------------------------------------------
    async def get(self, session_id: str, owner: str) -> SessionMeta:
        meta, _ = await self.store.read(session_id, owner=owner)
        await self._touch(meta, owner)
        return meta

    async def fork(
        self,
        session_id: str,
        expected: int | None,
        owner: str,
        version: int | None = None,
        *,
        ttl: int | None = None,
        tokens_hash: str | None = None,
    ) -> SessionMeta:
        """A new session holding the state `session_id` had at `version` (a kept one; None:
        the current one), its transcript starting with that state's lineage. With
        `tokens_hash`, only if that state's tokens are those (else VersionGone)."""
        at = await self.store.read_at(session_id, version, owner, state=True, transcript=True)
        source = at.meta
        await self._touch(source, owner)
        if expected is not None and source.version != expected:
            raise VersionMismatch(session_id, expected, source.version)
        if tokens_hash is not None and at.tokens_hash != tokens_hash:
            raise VersionGone(session_id, at.version.version, -1)
        ttl = ttl or source.ttl
        assert at.state is not None and at.transcript is not None
        new_id = new_session_id()
        inherited = _lineage_bytes(at.transcript, session_id, at.version.version)
        inherited.append(Segment(new_id, 0, "fork", at.version.n_tokens, committed_at=time.time()).to_bytes())
        size = at.state.nbytes + sum(map(len, inherited))
        await self._reserve(owner, new_id, size, ttl, grows=True)
        try:
            meta = await self.store.create(
                at.state,
                at.version.n_tokens,
                source.model,
                source.fingerprint,
                ttl,
                owner,
                new_id,
                keep=source.keep_versions,
                transcript=inherited,
                tokens_hash=at.tokens_hash,
            )
        except BaseException:
            await self.store.forget(owner, new_id)
            raise
        await self._index(owner, meta)
        return await self._settle(owner, meta)

    async def delete(self, session_id: str, expected: int | None, owner: str) -> None:
        await self.store.delete(session_id, expected, owner)
        self.cache.drop(session_id)
        self._seen(owner, await self.store.forget(owner, session_id))

    async def listing(self, owner: str, cursor: int, count: int) -> tuple[list[SessionMeta], int]:
        """A page of the caller's own sessions, and the next page's cursor (0: no more)."""
        return await self.store.list_sessions(owner, cursor, count)

    async def export(
        self, session_id: str, owner: str, dtype: str, expected: int | None, version: int | None = None
    ) -> tuple[SessionMeta, int, bytes]:
        """The committed state (or a kept `version`'s) as one snapshot in `dtype`: the state
        format itself (safetensors plus its JSON header with the model's fingerprint and a
        checksum). Returns the session, the version exported, and the bytes."""
        if version is not None:
            at = await self._read_version(session_id, version, expected, owner)
            res = await self._run(Request(self._stored(at), [], persist=Persist(dtype)))
            assert res.encoded is not None
            return at.meta, version, res.encoded.blob
        meta, start = await self._read(session_id, expected, owner)
        res = await self._run(Request(start, [], persist=Persist(dtype)))
        self._keep_loaded(meta, res)
        await self._touch(meta, owner)
        assert res.encoded is not None
        return meta, meta.version, res.encoded.blob

    # -- prefix reuse ----------------------------------------------------------------------------
    async def stateless(self, ids: list[int], owner: str, reuse: bool = True) -> tuple[str, list[int]]:
        """A session for a request that names none, and the ids it has yet to consume: a
        fork of the owner's longest committed state whose tokens are a prefix of BOS+`ids`
        (the matched session itself is never touched), or a new session holding BOS. Either
        lives `stateless_ttl`, so stateless traffic leaves no long-lived sessions behind.
        `reuse=False`: always the new session (the request must consume its whole prompt)."""
        tokens = self._with_bos(ids)
        if self.prefix_reuse and reuse:
            hashes = prefixes.prefixes(prefixes.root(self.engine.fingerprint), tokens)
            # (longest first; a prefix of BOS alone saves nothing a create would not do)
            found = await self.store.find_prefix(owner, hashes[::-1][: max(0, len(tokens) - 1)])
            if found is not None:
                i, sid, version = found
                n = len(tokens) - i
                try:
                    meta = await self.fork(
                        sid, None, owner, version, ttl=self.stateless_ttl, tokens_hash=hashes[n - 1]
                    )
                except (SessionNotFound, VersionGone):  # expired, or a stale entry: prefill it all
                    pass
                else:
                    metrics.PREFIX_REUSE_HITS.inc()
                    metrics.PREFIX_TOKENS_SAVED.inc(n)
                    return meta.id, tokens[n:]
            metrics.PREFIX_REUSE_MISSES.inc()
        return (await self.create([], self.stateless_ttl, owner)).id, ids

    async def _index(self, owner: str, meta: SessionMeta) -> None:
        """Index a committed state by its tokens (best effort: a lost entry costs a prefill)."""
        if not self.prefix_reuse or meta.tokens_hash == prefixes.UNKNOWN or meta.n_tokens < 2:
            return
        try:
            await self.store.index_prefix(owner, meta.tokens_hash, meta.id, meta.version, meta.ttl)
        except StoreUnavailable:
            log.warning("could not index the tokens of session %s for prefix reuse", meta.id)

    # -- history -----------------------------------------------------------------------------
    async def versions(self, session_id: str, owner: str) -> tuple[SessionMeta, list[Version]]:
        """The session and the versions it keeps (oldest first)."""
        meta, kept = await self.store.versions(session_id, owner)
        await self._touch(meta, owner)
        return meta, kept

    async def transcript(
        self, session_id: str, owner: str, since_version: int | None = None
    ) -> tuple[SessionMeta, list[Segment], bool]:
        """The segments the current state consumed, in order (only the session's own
        versions after `since_version`, when given), and whether that history is complete."""
        at = await self.store.read_at(session_id, None, owner, transcript=True)
        assert at.transcript is not None
        await self._touch(at.meta, owner)
        segments, complete = lineage(
            [Segment.from_bytes(b) for b in at.transcript], session_id, at.meta.version
        )
        if since_version is not None:
            segments = [g for g in segments if g.session_id == session_id and g.version > since_version]
        return at.meta, segments, complete and not at.trimmed

    async def rollback(self, session_id: str, version: int, expected: int | None, owner: str) -> SessionMeta:
        """Make a kept version's state current again, as a new version (fenced like every
        write): history only moves forward, and the versions rolled back over stay kept."""
        writer, _ = await self._begin(session_id, expected, owner)
        try:
            at = await self._read_version(session_id, version, None, owner)
            res = await self._run(Request(self._stored(at), [], persist=Persist(self.state_dtype)))
            segment = Segment(session_id, writer.meta.version + 1, "rollback", res.n_tokens, restores=version)
            return await self._commit(writer, res, owner, segment, at.tokens_hash)
        finally:
            await self._release(writer, owner)

    async def _read_version(
        self, session_id: str, version: int, expected: int | None, owner: str
    ) -> AtVersion:
        at = await self.store.read_at(session_id, version, owner, state=True)
        await self._touch(at.meta, owner)
        if expected is not None and at.meta.version != expected:
            raise VersionMismatch(session_id, expected, at.meta.version)
        self._same_model(at.meta)
        return at

    @staticmethod
    def _stored(at: AtVersion) -> Stored:
        assert at.state is not None
        return Stored(at.state.snapshot, at.state.deltas, at.version.n_tokens)

    async def import_state(
        self, body: Callable[[], Awaitable[bytes]], declared: int | None, ttl: int, owner: str
    ) -> SessionMeta:
        """A new session, owned by `owner`, holding an exported state that `body` reads.
        Before a byte of it is read: a place among this replica's imports in progress
        (QueueFull past `max_imports`) and one in the tenant's quota for its `declared` size
        (QuotaExceeded). Then its headers are checked here (`model.state.peek`: bounded, so
        cheap on the event loop) and the engine thread parses and verifies the rest
        (container, checksum, the served model's fingerprint, shapes, sizes, values). It is
        never unpickled."""
        if self._imports >= self.max_imports:
            raise QueueFull(
                f"{self._imports} state imports are in progress on this server, its limit; retry shortly"
            )
        self._imports += 1
        session_id = new_session_id()
        try:
            await self._reserve(owner, session_id, declared or 0, ttl, grows=True)
            blob = await body()
            head = peek(blob)
            n_tokens = _one_count(head.header.get("n_tokens"))
            shape = head.tensors.get("n_tokens", ("", []))[1]
            if head.header.get("delta") is not None or shape != [1] or n_tokens is None:
                raise StateError("only a single-stream snapshot (as GET .../state exports it) can be imported")
            req = Request(Stored(blob, (), n_tokens), [], persist=Persist(self.state_dtype))
            return await self._create(req, ttl, owner, None, "import", session_id)
        except StateError as exc:
            await self.store.forget(owner, session_id)
            raise StateRejected(f"the state cannot be imported: {exc}") from None
        except BaseException:
            await self.store.forget(owner, session_id)
            raise
        finally:
            self._imports -= 1

    # -- transactions ----------------------------------------------------------------------------
    async def create(self, ids: list[int], ttl: int, owner: str, keep: int | None = None) -> SessionMeta:
        """A new session, owned by `owner`, with BOS (if the model has one) and `ids` consumed,
        keeping its last `keep` versions (None: the service's default)."""
        prompt = self._with_bos(ids)
        return await self._create(Request(None, prompt, persist=Persist(self.state_dtype)), ttl, owner, keep)

    def _with_bos(self, ids: list[int]) -> list[int]:
        """What a new state consumes for `ids`: BOS first, if the model has one."""
        bos = self.engine.tokenizer.bos_id
        return ([bos] if bos is not None else []) + ids

    async def _create(
        self,
        req: Request,
        ttl: int,
        owner: str,
        keep: int | None,
        kind: Kind = "create",
        session_id: str | None = None,
    ) -> SessionMeta:
        """A new session holding the state `req` makes (under `session_id`, when the caller
        has reserved its place in the tenant's quota)."""
        # a place in the tenant's quota first: Redis down, or the tenant at its limit, fails
        # fast, before any model time is spent
        if session_id is None:
            session_id = new_session_id()
            await self._reserve(owner, session_id, 0, ttl, grows=True)
        try:
            res = await self._run(req)
            assert res.encoded is not None and res.encoded.kind == "snapshot"
            blob = res.encoded.blob
            segment = Segment(
                session_id, 0, kind, res.n_tokens - len(req.prompt), req.prompt, committed_at=time.time()
            ).to_bytes()
            size = len(blob) + len(segment)
            await self._reserve(owner, session_id, size, ttl, grows=True)
            tokens = prefixes.extend(prefixes.root(self.engine.fingerprint), req.prompt)
            meta = await self.store.create(
                StateBlobs(blob),
                res.n_tokens,
                self.engine.name,
                self.engine.fingerprint,
                ttl,
                owner,
                session_id,
                keep=keep or self.history_versions,
                transcript=[segment],
                tokens_hash=prefixes.UNKNOWN if kind == "import" else tokens,
            )
        except BaseException:
            await self.store.forget(owner, session_id)
            raise
        self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.state))
        logs.session_id.set(meta.id)
        await self._index(owner, meta)
        return await self._settle(owner, meta)

    async def score(
        self, session_id: str, ids: list[int], *, commit: bool, expected: int | None, owner: str
    ) -> tuple[SessionMeta, list[float | None]]:
        """Teacher-forced log-probs of `ids` continuing the session; with `commit`, the
        session goes on from after them."""
        if not commit:
            meta, start = await self._read(session_id, expected, owner)
            res = await self._run(Request(start, ids, prompt_logprobs=True))
            self._keep_loaded(meta, res)
            await self._touch(meta, owner)
            return meta, res.prompt_logprobs
        writer, start = await self._begin(session_id, expected, owner)
        try:
            res = await self._run(
                Request(start, ids, prompt_logprobs=True, persist=self.persist_for(writer.meta))
            )
            segment = Segment(session_id, writer.meta.version + 1, "score", writer.meta.n_tokens, ids)
            return await self._commit(writer, res, owner, segment), res.prompt_logprobs
        finally:
            await self._release(writer, owner)

    async def generate(
        self,
        session_id: str,
        ids: list[int],
        *,
        params: SamplingParams,
        seed: int | None,
        max_tokens: int,
        stop: list[str],
        expected: int | None,
        owner: str,
        started: float | None = None,
        keep_on_disconnect: bool = False,
        logprobs: Logprobs | None = None,
    ) -> Run:
        """Take the lock, find the starting state and start generating; the caller owns the
        `Run` (stream or complete it, and always close it). `logprobs` asks for alternatives
        and the prompt's log-probs (`Run.result`)."""
        started = time.perf_counter() if started is None else started
        writer, start = await self._begin(session_id, expected, owner)
        try:
            extra = logprobs or Logprobs()
            req = Request(start, ids, params, seed, max_tokens, stop, persist=self.persist_for(writer.meta))
            req.prompt_logprobs, req.top_logprobs = extra.prompt, extra.top
            self._submit(req)
        except BaseException:
            await self._release(writer, owner)
            raise
        run = Run(self, req, writer, owner, ids, started)
        run.keep_on_disconnect = keep_on_disconnect
        return run

    # -- the steps ---------------------------------------------------------------------------------
    async def _begin(
        self, session_id: str, expected: int | None, owner: str
    ) -> tuple[Writer, State | Stored]:
        """1 and 2: the writer lock and the starting state. On any error the lock is released."""
        held = self.cache.get(session_id)
        writer = await self.store.begin(session_id, expected, held.commit_id if held else None, owner)
        try:
            return writer, self._start(writer.meta, writer.state, held)
        except BaseException:
            await self._release(writer, owner)
            raise

    async def _read(
        self, session_id: str, expected: int | None, owner: str
    ) -> tuple[SessionMeta, State | Stored]:
        """2 without the lock, for read-only requests."""
        held = self.cache.get(session_id)
        meta, blobs = await self.store.read(
            session_id, with_state=True, held_commit=held.commit_id if held else None, owner=owner
        )
        if expected is not None and meta.version != expected:
            raise VersionMismatch(session_id, expected, meta.version)
        return meta, self._start(meta, blobs, held)

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
        req.tenant = CLIENT.get()
        return self.engine.submit(req)

    async def _run(self, req: Request) -> Finished:
        """3, for a request whose tokens nobody streams."""
        return await self._submit(req).finished()

    def persist_for(self, meta: SessionMeta) -> Persist:
        """The persistence policy: how a commit on top of `meta` stores its new state."""
        if not self.delta_persistence or meta.snapshot_bytes == 0:
            return Persist(self.state_dtype)
        return Persist(
            self.state_dtype, since=meta.n_tokens, delta_budget=meta.snapshot_bytes - meta.delta_bytes
        )

    async def _commit(
        self, writer: Writer, res: Finished, owner: str, segment: Segment, tokens_hash: str | None = None
    ) -> SessionMeta:
        """4 and 5: the fenced commit of the new state and its transcript segment (within
        the tenant's quota and Redis's room), then the committed state kept hot and
        indexed by its tokens (`tokens_hash`; default: the old state's, extended by the
        segment's ids)."""
        assert res.encoded is not None
        old = writer.meta
        packed = dataclasses.replace(segment, committed_at=time.time()).to_bytes()
        # at most what the session will hold (a replaced chain moves to the history, when kept)
        kept = (
            old.snapshot_bytes + old.delta_bytes
            if res.encoded.kind == "delta" or old.keep_versions > 1
            else 0
        )
        size = len(res.encoded.blob) + len(packed) + old.history_bytes + kept
        await self._reserve(owner, old.id, size, old.ttl, grows=size > old.stored_bytes)
        if tokens_hash is None:
            tokens_hash = prefixes.extend(old.tokens_hash, segment.ids)
        meta = await writer.commit(
            res.n_tokens, **{res.encoded.kind: res.encoded.blob}, segment=packed, tokens_hash=tokens_hash
        )
        self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.state))
        await self._index(owner, meta)
        return await self._settle(owner, meta)

    async def _settle(self, owner: str, meta: SessionMeta) -> SessionMeta:
        """The tenant's ledger takes the session as the write left it: its size (the history
        and transcript bounds may have made it smaller than the reservation) and the expiry
        the write set (the reservation's was this replica's estimate)."""
        await self._touch(meta, owner)
        return meta

    async def _release(self, writer: Writer, owner: str) -> None:
        """Give up a writer's lock. A writer that did not commit had still re-armed its
        session's expiry (`begin` does): the ledger follows. Shielded, as the release is: a
        request cancelled by its client's hang-up still completes both."""

        async def release() -> None:
            if await writer.release():
                await self._touch(writer.meta, owner)

        await asyncio.shield(release())

    def _keep_loaded(self, meta: SessionMeta, res: Finished) -> None:
        """A read-only request loaded the current state from bytes: keep it hot."""
        if res.loaded is not None:
            self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.loaded))


class Run:
    """One generation holding its session's writer lock: iterate `stream()` (tokens, then
    the commit), or await `complete()`. Always `close()` it (idempotent)."""

    def __init__(
        self, sessions: Sessions, req: Request, writer: Writer, owner: str, prompt: list[int], started: float
    ):
        self.sessions = sessions
        self.req = req
        self.writer = writer
        self.owner = owner
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.started = started
        self.meta: SessionMeta | None = None  # the committed session, once committed
        self.tokens: list[TokenEvent] = []  # as handed to the client
        self.keep_on_disconnect = False  # `close` before the commit commits the tokens sent
        self.client: str | None = None  # whose stream it is, once admitted (`Sessions.starting`)
        self.reserved = 0  # tokens reserved for it in its tenant's bucket, once admitted
        self._ended = False
        self._keeping: asyncio.Future[None] | None = None
        metrics.PROMPT_TOKENS.inc(self.prompt_tokens)

    @property
    def version(self) -> int:
        """The version this generation commits as."""
        return self.writer.meta.version + 1

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Each token as it is sampled; after the last one the new state is committed
        (`self.meta`). An exception here means nothing was committed."""
        last = self.started
        async for ev in self.req:
            now = time.perf_counter()
            (metrics.INTER_TOKEN_LATENCY if self.tokens else metrics.TIME_TO_FIRST_TOKEN).observe(now - last)
            last = now
            metrics.GENERATION_TOKENS.inc()
            self.tokens.append(ev)
            yield ev
        res = self.result
        await self._end()
        self.meta = await self.sessions._commit(self.writer, res, self.owner, self.segment("generate"))
        metrics.E2E_REQUEST_LATENCY.observe(time.perf_counter() - self.started)
        metrics.REQUESTS_FINISHED.labels(res.finish_reason).inc()

    async def complete(self, disconnected: Awaitable[object]) -> SessionMeta:
        """Run to the commit without streaming. If `disconnected` (the client hanging up)
        completes first, the generation is abandoned and nothing is committed."""

        async def drain() -> None:
            async for _ in self.stream():
                pass

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(disconnected)
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientDisconnected("the client disconnected; nothing was committed")
            work.result()
        finally:
            work.cancel()
            watcher.cancel()
            await self.close()
        assert self.meta is not None
        return self.meta

    @property
    def result(self) -> Finished:
        assert self.req.result is not None
        return self.req.result

    def segment(self, kind: Kind) -> Segment:
        """This generation's transcript segment: the prompt, then the tokens handed out."""
        n = len(self.prompt)
        return Segment(
            self.writer.meta.id,
            self.version,
            kind,
            self.writer.meta.n_tokens,
            self.prompt + [ev.id for ev in self.tokens],
            [False] * n + [True] * len(self.tokens),
            [None] * n + [ev.logprob for ev in self.tokens],
            dataclasses.asdict(self.req.params),
            self.req.seed,
            self.req.result.finish_reason if kind == "generate" and self.req.result else None,
        )

    @property
    def finish_reason(self) -> FinishReason:
        return self.result.finish_reason

    @property
    def text(self) -> str:
        return self.result.text

    async def close(self) -> None:
        """Stop the generation (if still running) and release the lock (if not committed).
        With `keep_on_disconnect`, a generation cut short first commits the tokens it had
        handed out: in a task of its own, which completes even when the caller that
        started it is being cancelled (as a stream's is when its client hangs up)."""
        self.req.cancel()
        if self.keep_on_disconnect and self.meta is None and self.tokens and self._keeping is None:
            self._keeping = asyncio.ensure_future(self._keep())
        if self._keeping is not None:
            await asyncio.shield(self._keeping)
        await asyncio.shield(self._end())
        await self.sessions._release(self.writer, self.owner)

    def admitted(self, client: str, reserved: int) -> None:
        """Its place among `client`'s streams and `reserved` tokens are now its own."""
        self.client, self.reserved = client, reserved

    async def _end(self) -> None:
        """Once: the tokens handed out count against the tenant (committed or not); its
        stream's place and the tokens reserved and not drawn go back."""
        if not self._ended:
            self._ended = True
            await self.sessions.ended(self)

    async def _keep(self) -> None:
        """Commit the starting state with the prompt and exactly the tokens handed out
        consumed: teacher-forced anew (a recurrent state cannot be rolled back), which by
        boundary invariance is the state the generation had after them. On failure the
        session stays as it was."""
        s = self.sessions
        try:
            await self._end()
            ids = self.prompt + [ev.id for ev in self.tokens]
            res = await s._run(Request(self.req.start, ids, persist=self.req.persist))
            self.meta = await s._commit(self.writer, res, self.owner, self.segment("keep"))
        except Exception:
            log.warning("could not keep the tokens of a generation cut short", exc_info=True)
        finally:
            await s._release(self.writer, self.owner)


def _one_count(claim: object) -> int | None:
    """The count a state header's `n_tokens` claims for its one stream, if it claims one."""
    if isinstance(claim, list) and len(claim) == 1 and type(claim[0]) is int and claim[0] >= 0:
        return claim[0]
    return None


def _lineage_bytes(stored: list[bytes], session_id: str, version: int) -> list[bytes]:
    """The stored segments (as stored) of the lineage of `session_id` at `version`."""
    segments = [Segment.from_bytes(raw) for raw in stored]
    packed = {id(seg): raw for raw, seg in zip(stored, segments, strict=True)}
    return [packed[id(seg)] for seg in lineage(segments, session_id, version)[0]]


# -- assembly ------------------------------------------------------------------------------------
def build_engine(settings: Settings, lm: LanguageModel, name: str) -> Engine:
    """The engine as `settings` describe it (not yet started)."""
    return Engine(
        lm,
        name=name,
        max_batch_size=settings.max_batch_size,
        max_queued_requests=settings.max_queued_requests,
        max_queued_tokens=settings.max_queued_tokens,
        cpu_threads=settings.cpu_threads,
        compile=settings.compile,
        malloc_trim_interval=settings.malloc_trim_interval,
        step_deadline=settings.engine_step_deadline,
        fairness=Fairness(
            batch_share=settings.key_batch_share,
            queue_share=settings.key_queue_share,
            buffer_tokens=settings.stream_buffer_tokens,
        ),
    )


def build(settings: Settings, store: SessionStore, engine: Engine) -> Sessions:
    """The service as `settings` describe it, over this store and engine."""
    return Sessions(
        store,
        engine,
        hot_cache_bytes=int(settings.hot_cache_mb * 2**20),
        state_dtype=settings.state_dtype,
        delta_persistence=settings.delta_persistence,
        limits=settings.limits(),
        tenants={owner_of(key): limits for key, limits in settings.load_tenants().items()},
        storage_guard=settings.storage_guard,
        history_versions=settings.history_versions,
        prefix_reuse=settings.prefix_reuse,
        stateless_ttl=settings.stateless_session_ttl,
        # a small multiple of the largest state the served model can produce, unless set
        import_limit=int(settings.max_import_mb * 2**20) or 2 * engine.lm.max_state_bytes(),
        max_imports=settings.max_concurrent_imports,
        max_streams=settings.max_streams_per_key,
    )
