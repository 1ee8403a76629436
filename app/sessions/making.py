"""The writes that make a session: a new one holding a prompt's state (`create`), an
exported state imported (`import_state`: its place among the replica's imports, its pace,
its checks), a fork of a kept version (`fork`). Each takes its place in the tenant's quota
before any model time is spent, and leaves nothing behind when it fails before its
write. `SessionService` (service.py) adds the transactions on an existing session.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from app import logs, prefixes
from app.engine import Engine, QueueFull, Request, Stored
from app.store import (
    OutcomeUnknown,
    SessionMeta,
    SessionStore,
    StateBlobs,
    VersionGone,
    VersionMismatch,
    fork_id,
    new_session_id,
)
from app.tenants import CLIENT, Pace, Tenants
from app.transcript import Kind, Segment, lineage
from model import StateError
from model.state import Persist, peek

from .cache import Held, HotCache
from .reads import SessionReads


class StateRejected(Exception):
    """A state offered for import that this server cannot take: damaged, or another model's."""


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


class SessionMaking(SessionReads):
    """The service's settings, and the writes that make a session: a new one (`create`),
    an imported state (`import_state`), a fork (`fork`)."""

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
        tenant's quota for its `declared` size (QuotaExceeded). Then its headers are checked
        here (`_importable`) and the loader thread parses and verifies the rest (container,
        checksum, the served model's fingerprint, shapes, sizes, values). It is never
        unpickled; a blob already in the stored form is committed as it came."""
        client = CLIENT.get() or owner
        with self.imports.taken(client):
            session_id = new_session_id()
            try:
                await self.tenants.reserve(owner, session_id, declared or 0, ttl)
                await self.imports.pace.take(client, declared or 0)
                blob = await body()
                if declared is None:  # (a body of no stated length is paced once read)
                    await self.imports.pace.take(client, len(blob))
                # (the loader verifies the blob before the engine takes it: its commit writes it as it
                # is, when it is in the stored form, instead of encoding the state again)
                stored, persist = (
                    Stored(blob, (), _importable(blob)),
                    Persist(self.state_dtype, verified=blob),
                )
                req = Request(stored, [], persist=persist)
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
        async with self._placed(owner, session_id):
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
        the current one), its transcript starting with that state's lineage: a session of
        its family, naming that version's pages in Redis (no state read or written). With
        `tokens_hash`, only if that state's tokens are those (else VersionGone); `ephemeral`
        as `create`'s."""
        for attempt in range(FORK_TRIES):
            at = await self.store.read_at(session_id, version, owner, transcript=True)
            source = at.meta
            await self.tenants.touch(owner, source)
            if expected is not None and source.version != expected:
                raise VersionMismatch(session_id, expected, source.version)
            if tokens_hash is not None and at.tokens_hash != tokens_hash:
                raise VersionGone(session_id, at.version.version, -1)
            assert at.transcript is not None
            new_id, ttl = fork_id(session_id), ttl or source.ttl
            inherited = _lineage_bytes(at.transcript, session_id, at.version.version)
            inherited.append(
                Segment(new_id, 0, "fork", at.version.n_tokens, committed_at=time.time()).to_bytes()
            )
            # (its quota counts the state it holds, though its pages are its source's: a key
            # may not hold more state than its quota by forking and deleting the source)
            size = at.state_bytes + sum(map(len, inherited))
            await self.tenants.reserve(owner, new_id, size, ttl, ephemeral)
            try:
                async with self._placed(owner, new_id):
                    meta = await self.store.fork(
                        session_id, at.version.version, owner, new_id, ttl=ttl, keep=source.keep_versions,
                        transcript=inherited, tokens_hash=at.tokens_hash,
                    )  # fmt: skip
            except VersionGone:
                # the current version, read a moment ago, was replaced meanwhile (and not kept):
                # the fork asked for the current one, so it takes the new one
                if version is not None or tokens_hash is not None or attempt == FORK_TRIES - 1:
                    raise
                continue
            break
        return await self.tenants.settled(owner, meta, index=self.prefix_reuse)

    @contextlib.asynccontextmanager
    async def _placed(self, owner: str, session_id: str) -> AsyncIterator[None]:
        """The block that writes a new session whose place in the tenant's ledger is taken:
        if it fails, the place leaves the ledger, unless the write's outcome is unknown
        (the session may exist: its place stays)."""
        try:
            yield
        except OutcomeUnknown:
            raise
        except BaseException:
            await self.tenants.forget(owner, session_id)
            raise


FORK_TRIES = 3  # a fork of the current version, while commits replace it


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
