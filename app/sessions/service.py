"""The writes: a session's whole transaction, from its lock to its commit.

Every write (create, generate, score with `commit`, rollback) reads top to bottom here:

  1. lock: take the session's writer lock in Redis (`SessionStore.begin`);
  2. start: find the starting state (reads.py: the hot copy Redis confirmed, or bytes);
  3. run: one engine `Request`, which carries the starting state in and the committed
     state, already encoded, out (the engine never calls back here);
  4. reserve: a commit that grows the session, within its tenant's quota and Redis's room
     (`Tenants.reserve_growth`);
  5. commit: write a delta or a snapshot (the persistence policy, `persist_for`), fenced on
     the version the lock was taken at, so a writer whose lease lapsed can never overwrite
     a newer commit; keep the committed state in the hot cache;
  6. settle: the tenant's ledger takes the session as the commit left it, and the prefix
     index its state (`Tenants.settle`: one round trip).

Whatever happens, the lock is released, and a request that did not reach step 5 changed
nothing (but for `on_disconnect: commit`, `Run.close`). Creates, forks and imports take
their place in the tenant's quota before any model time is spent.

Persistence policy: a request that started from a stored snapshot commits only what
changed (a delta) unless the deltas stored since the snapshot would then outweigh the
snapshot itself; then it writes a fresh snapshot, which also clears the deltas. Bytes
written per request therefore grow with the new tokens, and a full read never merges
more than about one snapshot's worth of deltas.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from app import logs, prefixes
from app.engine import Engine, Finished, Logprobs, QueueFull, Request, Stored
from app.store import (
    OutcomeUnknown,
    SessionMeta,
    SessionStore,
    StateBlobs,
    VersionGone,
    VersionMismatch,
    Writer,
    new_session_id,
)
from app.tenants import CLIENT, Pace, Tenants
from app.transcript import Kind, Segment, lineage
from model import State, StateError
from model.grammar import Matcher
from model.sampling import SamplingParams
from model.state import Persist, peek

from .cache import Held, HotCache
from .reads import SessionReads, _stored
from .run import Run


class StateRejected(Exception):
    """A state offered for import that this server cannot take: damaged, or another model's."""


@dataclass
class Generation:
    """What a generation samples, and how: the sampling controls, seed, limits and stop
    strings; with `keep_on_disconnect`, a stream cut short commits the tokens it sent;
    `logprobs` asks for alternatives and the prompt's log-probs (`Run.result`)."""

    params: SamplingParams
    max_tokens: int
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    keep_on_disconnect: bool = False
    logprobs: Logprobs = field(default_factory=Logprobs)
    started: float = field(default_factory=time.perf_counter)
    grammar: Matcher | None = None  # the output's grammar, compiled; each run samples under a copy


class ImportPlaces:
    """The replica's places for state imports in progress: `max_places` in all, and half of
    them (at least one) for one client, so a client importing in a loop leaves the others a
    place; and each client's imports paced to `rate` bytes a second after a burst of
    `burst` seconds' worth (one full state at once), so it leaves them the replica's cores
    (an import costs the event loop, the loader and the encoder per byte). Both are taken
    before a byte of the body is read."""

    def __init__(self, max_places: int, rate: float = 0.0, burst: float = 4.0):
        self.max_places = max_places
        self.pace = Pace(rate, burst)
        self._taken: collections.Counter[str] = collections.Counter()  # by client

    @contextlib.contextmanager
    def taken(self, client: str) -> Iterator[None]:
        """A place for `client` for the block; QueueFull when there is none."""
        if self._taken.total() >= self.max_places:
            raise QueueFull(
                f"{self._taken.total()} state imports are in progress on this server, its limit; retry shortly"
            )
        if self._taken[client] >= max(1, self.max_places // 2):
            raise QueueFull(
                f"this client has {self._taken[client]} state imports in progress on this server, its "
                "limit; retry when one has ended"
            )
        self._taken[client] += 1
        try:
            yield
        finally:
            self._taken[client] -= 1
            if not self._taken[client]:
                del self._taken[client]


class SessionService(SessionReads):
    def __init__(
        self,
        store: SessionStore,
        tenants: Tenants,
        engine: Engine,
        cache: HotCache,
        *,
        state_dtype: str,
        delta_persistence: bool,
        history_versions: int,
        prefix_reuse: bool,
        stateless_ttl: int,
        import_limit: int,
        max_imports: int,
        import_rate: float = 0.0,
    ):
        super().__init__(store, tenants, engine, cache)
        self.state_dtype = state_dtype
        self.delta_persistence = delta_persistence
        self.history_versions = history_versions  # kept versions of a session that asks for no number
        self.prefix_reuse = prefix_reuse
        self.stateless_ttl = stateless_ttl
        self.import_limit = import_limit  # bytes: the largest state a client may import
        self.imports = ImportPlaces(max_imports, import_rate)

    # -- new sessions -------------------------------------------------------------------------
    async def create(
        self, ids: list[int], ttl: int, owner: str, keep: int | None = None, ephemeral: bool = False
    ) -> SessionMeta:
        """A new session, owned by `owner`, with BOS (if the model has one) and `ids` consumed,
        keeping its last `keep` versions (None: the service's default); `ephemeral`, one
        made for a single request (the listing hides it by default)."""
        req = Request(None, self.with_bos(ids), persist=Persist(self.state_dtype))
        return await self._create(req, ttl, owner, keep, ephemeral=ephemeral)

    def with_bos(self, ids: list[int]) -> list[int]:
        """What a new state consumes for `ids`: BOS first, if the model has one."""
        bos = self.engine.tokenizer.bos_id
        return ([bos] if bos is not None else []) + ids

    async def import_state(
        self, body: Callable[[], Awaitable[bytes]], declared: int | None, ttl: int, owner: str
    ) -> SessionMeta:
        """A new session, owned by `owner`, holding an exported state that `body` reads.
        Before a byte of it is read: a place among this replica's imports in progress
        (QueueFull past `max_imports`, or past half of them for one client: a client
        importing in a loop leaves others a place, and the replica's cores) and one in the
        tenant's quota for its `declared` size
        (QuotaExceeded). Then its headers are checked here (`_importable`) and the loader
        thread parses and verifies the rest
        (container, checksum, the served model's fingerprint, shapes, sizes, values). It is
        never unpickled."""
        client = CLIENT.get() or owner
        with self.imports.taken(client):
            session_id = new_session_id()
            try:
                await self.tenants.reserve(owner, session_id, declared or 0, ttl)
                await self.imports.pace.take(client, declared or 0)
                blob = await body()
                if declared is None:  # (a body of no stated length is paced once read)
                    await self.imports.pace.take(client, len(blob))
                req = Request(Stored(blob, (), _importable(blob)), [], persist=Persist(self.state_dtype))
                return await self._create(req, ttl, owner, None, "import", session_id)
            except StateError as exc:
                await self.tenants.forget(owner, session_id)
                raise StateRejected(f"the state cannot be imported: {exc}") from None
            except OutcomeUnknown:
                raise  # (the session may exist: its place in the ledger stays)
            except BaseException:
                await self.tenants.forget(owner, session_id)
                raise

    async def _create(
        self,
        req: Request,
        ttl: int,
        owner: str,
        keep: int | None,
        kind: Kind = "create",
        session_id: str | None = None,
        ephemeral: bool = False,
    ) -> SessionMeta:
        """A new session holding the state `req` makes (under `session_id`, when the caller
        has taken its place in the tenant's quota): its place first (Redis down, or the
        tenant at its limit, fails fast, before any model time is spent), then its bytes."""
        if session_id is None:
            session_id = new_session_id()
            await self.tenants.admit_session(owner, session_id, ttl, ephemeral)
        try:
            res = await self._finish(req)
            assert res.encoded is not None and res.encoded.kind == "snapshot"
            blob = res.encoded.blob
            segment = Segment(
                session_id, 0, kind, res.n_tokens - len(req.prompt), req.prompt, committed_at=time.time()
            ).to_bytes()
            await self.tenants.reserve(owner, session_id, len(blob) + len(segment), ttl)
            tokens = prefixes.extend(prefixes.root(self.engine.fingerprint), req.prompt)
            meta = await self.store.create(
                StateBlobs(blob), res.n_tokens, self.engine.name, self.engine.fingerprint, ttl, owner, session_id,
                keep=keep or self.history_versions, transcript=[segment],
                tokens_hash=prefixes.UNKNOWN if kind == "import" else tokens,
            )  # fmt: skip
        except OutcomeUnknown:
            raise  # (the session may exist: its place in the ledger stays)
        except BaseException:
            await self.tenants.forget(owner, session_id)
            raise
        self.cache.put(meta.id, Held(meta.version, meta.commit_id, res.state))
        logs.session_id.set(meta.id)
        return await self.tenants.settled(owner, meta, index=self.prefix_reuse)

    async def fork(
        self,
        session_id: str,
        expected: int | None,
        owner: str,
        version: int | None = None,
        *,
        ttl: int | None = None,
        tokens_hash: str | None = None,
        ephemeral: bool = False,
    ) -> SessionMeta:
        """A new session holding the state `session_id` had at `version` (a kept one; None:
        the current one), its transcript starting with that state's lineage. With
        `tokens_hash`, only if that state's tokens are those (else VersionGone); `ephemeral`
        as `create`'s."""
        at = await self.store.read_at(session_id, version, owner, state=True, transcript=True)
        source = at.meta
        await self.tenants.touch(owner, source)
        if expected is not None and source.version != expected:
            raise VersionMismatch(session_id, expected, source.version)
        if tokens_hash is not None and at.tokens_hash != tokens_hash:
            raise VersionGone(session_id, at.version.version, -1)
        assert at.state is not None and at.transcript is not None
        new_id, ttl = new_session_id(), ttl or source.ttl
        inherited = _lineage_bytes(at.transcript, session_id, at.version.version)
        inherited.append(Segment(new_id, 0, "fork", at.version.n_tokens, committed_at=time.time()).to_bytes())
        await self.tenants.reserve(owner, new_id, at.state.nbytes + sum(map(len, inherited)), ttl, ephemeral)
        try:
            meta = await self.store.create(
                at.state, at.version.n_tokens, source.model, source.fingerprint, ttl, owner, new_id,
                keep=source.keep_versions, transcript=inherited, tokens_hash=at.tokens_hash,
            )  # fmt: skip
        except OutcomeUnknown:
            raise  # (the session may exist: its place in the ledger stays)
        except BaseException:
            await self.tenants.forget(owner, new_id)
            raise
        return await self.tenants.settled(owner, meta, index=self.prefix_reuse)

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
        run.keep_on_disconnect = gen.keep_on_disconnect
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


def _importable(blob: bytes) -> int:
    """The token count an imported blob's header claims, once its header shows a single-stream
    snapshot (`model.state.peek`: bounded, so cheap on the event loop); else StateError."""
    head = peek(blob)
    n_tokens = _one_count(head.header.get("n_tokens"))
    shape = head.tensors.get("n_tokens", ("", []))[1]
    if head.header.get("delta") is not None or shape != [1] or n_tokens is None:
        raise StateError("only a single-stream snapshot (as GET .../state exports it) can be imported")
    return n_tokens


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
