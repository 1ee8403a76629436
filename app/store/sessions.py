"""Sessions in Redis: each operation on one session is one script on its own keys (`{ID}`).

`begin` takes the writer lock and reads the state in one step; `Writer.commit` writes the
new state only if the version is still the one `begin` read (the fence), so a writer whose
lock lease expired can never overwrite a newer commit. A commit either appends a delta or
replaces the snapshot and clears the deltas, in the same step as the version bump; it
moves a replaced snapshot chain into the history while a kept version still needs it,
drops what no kept version needs any more, and appends its transcript segment: so a kept
version, the transcript and the current state never disagree. Reads accept the commit id
of the state the caller already holds (a hot cache) and then return no state bytes when it
is still the current one. Commit ids, unlike version numbers, are never issued twice, even
after Redis loses a commit. Each use of a session re-arms its TTL (sliding expiry). A fork
is one script over both sessions, which share a family and so a slot: it names the
source's pages (a kept version's snapshot and deltas) instead of copying them. The key
schema: app/store/keys.py; the scripts: app/store/lua/.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from app import metrics

from .connection import Connection
from .keys import SESSION_ID, Keys, family
from .types import (
    AtVersion,
    CommitConflict,
    SessionBusy,
    SessionMeta,
    SessionNotFound,
    StateBlobs,
    StoreError,
    Version,
    VersionGone,
    VersionMismatch,
    fields,
    new_commit_id,
    new_session_id,
)


class SessionStore:
    def __init__(
        self, connection: Connection, keys: Keys, *, lock_lease_seconds: float, transcript_max_bytes: int
    ):
        self.connection = connection
        self.keys = keys
        self.transcript_max_bytes = transcript_max_bytes
        self.lock_lease_ms = max(1, int(lock_lease_seconds * 1000))

    async def _run(self, name: str, session_id: str, args: list[Any], what: str = "", check: str = "") -> Any:
        """Script `name` on session `session_id`'s keys (a malformed id is no session); a
        write's `what` and `check` name it when its outcome is unknown (OutcomeUnknown)."""
        if not SESSION_ID.fullmatch(session_id):
            raise SessionNotFound(session_id)
        return await self.connection.run(name, self.keys.of_session(session_id), args, what, check)

    async def create(
        self,
        state: StateBlobs,
        n_tokens: int,
        model: str,
        fingerprint: str,
        ttl: int,
        owner: str = "",
        session_id: str | None = None,
        keep: int = 1,
        transcript: list[bytes] | tuple[bytes, ...] = (),
        tokens_hash: str = "",
    ) -> SessionMeta:
        """A new session (under `session_id`, when the caller has reserved one), keeping its
        last `keep` versions, its transcript starting with the `transcript` segments."""
        while True:  # 128 random bits never collide in practice; the script refuses if they do
            sid = session_id or new_session_id()
            args = [
                int(ttl), model, fingerprint, int(n_tokens), owner, new_commit_id(), int(keep),
                self.transcript_max_bytes, len(state.deltas), tokens_hash, state.snapshot, *state.deltas,
                *transcript,
            ]  # fmt: skip
            what, check = f"creating session {sid}", f"read session {sid} (not found: it was not created)"
            raw = await self._run("create", sid, args, what, check)
            if raw:
                metrics.STATE_BYTES_WRITTEN.inc(state.nbytes)
                return SessionMeta.from_fields(sid, fields(raw)["meta"])
            if session_id is not None:
                raise StoreError(f"session id {session_id} is taken")

    async def read(
        self, session_id: str, with_state: bool = False, held_commit: str | None = None, owner: str = ""
    ) -> tuple[SessionMeta, StateBlobs | None]:
        """Metadata (and the committed state), re-arming the TTL. No lock needed. With
        `held_commit` (the commit id of a state the caller already holds), the state bytes
        come back only if the session has moved past it."""
        raw = await self._run("read", session_id, ["1" if with_state else "0", held_commit or "", owner, "1"])
        if not raw:
            raise SessionNotFound(session_id)
        answer = fields(raw)
        return SessionMeta.from_fields(session_id, answer["meta"]), _read_blobs(answer)

    async def peek(
        self, session_ids: list[str], owner: str, head: int = 0
    ) -> list[tuple[SessionMeta, list[bytes]]]:
        """The metadata of those of `session_ids` that the owner still has, and the first
        `head` segments of each one's transcript, without touching their TTL (a listing is no
        use of a session)."""
        answers = await asyncio.gather(
            *(self._run("read", sid, ["0", "", owner, "0", head]) for sid in session_ids)
        )
        out = []
        for sid, raw in zip(session_ids, answers, strict=True):
            if raw:
                answer = fields(raw)
                segments = [bytes(s) for s in answer.get("head", [])]
                out.append((SessionMeta.from_fields(sid, answer["meta"]), segments))
        return out

    async def read_at(
        self,
        session_id: str,
        version: int | None,
        owner: str,
        *,
        state: bool = False,
        transcript: bool = False,
    ) -> AtVersion:
        """A kept version (None: the current one): its state and the transcript when asked
        for, read in one step (so they agree). VersionGone past the kept history."""
        args = [owner, _arg(version), "1" if state else "0", "1" if transcript else "0"]
        answer = _checked(await self._run("read_at", session_id, args), session_id, None)
        if answer["status"] == b"gone":
            raise VersionGone(session_id, -1 if version is None else version, int(answer["oldest"]))
        meta = SessionMeta.from_fields(session_id, answer["meta"])
        at = Version(
            meta.version if version is None else version,
            int(answer["n_tokens"]),
            float(answer["committed_at"]),
        )
        segments = [bytes(x) for x in answer["transcript"]] if transcript else None
        trimmed = transcript and answer["trimmed"] == b"1"
        blobs = _read_blobs(answer) if state else None
        tokens_hash = bytes(answer["tokens_hash"]).decode()
        return AtVersion(meta, at, blobs, segments, trimmed, tokens_hash, int(answer["state_bytes"]))

    async def fork(
        self,
        source: str,
        version: int,
        owner: str,
        new_id: str,
        *,
        ttl: int,
        keep: int,
        transcript: list[bytes],
        tokens_hash: str = "",
    ) -> SessionMeta:
        """A new session `new_id` (a `fork_id` of `source`: its family) holding `source`'s
        kept `version`, whose tokens hash to `tokens_hash` ('' for any; else VersionGone):
        it names that version's pages, and no state is read or written. Its transcript
        starts with the `transcript` segments."""
        if not (SESSION_ID.fullmatch(source) and SESSION_ID.fullmatch(new_id)):
            raise SessionNotFound(source)
        assert family(new_id) == family(source), "a fork lives in its source's family"
        keys = self.keys.of_session(source) + self.keys.of_session(new_id)[:5]
        args = [
            owner, int(version), tokens_hash, int(ttl), new_commit_id(), int(keep), self.transcript_max_bytes,
            *transcript,
        ]  # fmt: skip
        what, check = (
            f"forking session {source} as {new_id}",
            f"read session {new_id} (not found: it was not made)",
        )
        answer = _checked(await self.connection.run("fork", keys, args, what, check), source, None)
        if answer["status"] == b"gone":
            raise VersionGone(source, version, int(answer["oldest"]))
        if answer["status"] == b"taken":
            raise StoreError(f"session id {new_id} is taken")
        return SessionMeta.from_fields(new_id, answer["meta"])

    async def versions(self, session_id: str, owner: str) -> tuple[SessionMeta, list[Version]]:
        """The session and its kept versions, oldest first."""
        answer = _checked(await self._run("versions", session_id, [owner]), session_id, None)
        kept = [fields(v) for v in answer["versions"]]
        return SessionMeta.from_fields(session_id, answer["meta"]), [
            Version(int(v["version"]), int(v["n_tokens"]), float(v["committed_at"])) for v in kept
        ]

    async def retain(self, session_id: str, owner: str, ttl: int, holder: str = "") -> SessionMeta:
        """Give the session a new sliding TTL of `ttl` seconds, re-armed now (no lock: it
        writes no state, and a commit meanwhile re-arms by the same field); with `holder`
        (a response whose state it is), held by it until it lets go (`delete`)."""
        answer = _checked(await self._run("retain", session_id, [owner, ttl, holder]), session_id, None)
        return SessionMeta.from_fields(session_id, answer["meta"])

    async def delete(
        self, session_id: str, expected_version: int | None = None, owner: str = "", holder: str = ""
    ) -> bool:
        """Delete the session; with `holder`, that holder lets go of it first, and it is
        deleted only if no other holder is left: whether it was deleted."""
        args = [_arg(expected_version), owner, secrets.token_hex(16), holder]
        what, check = (
            f"deleting session {session_id}",
            f"read session {session_id} (not found: it was deleted)",
        )
        answer = _checked(
            await self._run("delete", session_id, args, what, check), session_id, expected_version
        )
        return answer["status"] != b"held"

    async def begin(
        self,
        session_id: str,
        expected_version: int | None = None,
        held_commit: str | None = None,
        owner: str = "",
    ) -> Writer:
        """The session's writer lock and its state (none when `held_commit` is current)."""
        token = secrets.token_hex(16)
        args = [token, self.lock_lease_ms, _arg(expected_version), held_commit or "", owner]
        answer = _checked(await self._run("begin", session_id, args), session_id, expected_version)
        return Writer(self, SessionMeta.from_fields(session_id, answer["meta"]), _read_blobs(answer), token)


def _read_blobs(answer: dict[str, Any]) -> StateBlobs | None:
    blobs = StateBlobs.of(answer)
    if blobs is not None:
        metrics.STATE_BYTES_READ.inc(blobs.nbytes)
    return blobs


def _checked(raw: list[Any], session_id: str, expected_version: int | None) -> dict[str, Any]:
    """A script's answer, by name; or the error its refusal (`missing`, `busy`, `mismatch`)
    stands for."""
    answer = fields(raw)
    status = answer["status"]
    if status == b"missing":
        raise SessionNotFound(session_id)
    if status == b"busy":  # with the lock's remaining lease, in ms
        raise SessionBusy(session_id, max(0, int(answer["pttl"])) / 1000)
    if status == b"mismatch":
        raise VersionMismatch(session_id, int(expected_version or 0), int(answer["version"]))
    return answer


def _arg(version: int | None) -> str:
    return "" if version is None else str(int(version))


async def _keep_alive(store: SessionStore, key: str, token: str) -> None:
    """Renew a writer's lease while its request works; if renewal fails, the fence still holds."""
    period = store.lock_lease_ms / 3000
    while True:
        await asyncio.sleep(period)
        with contextlib.suppress(StoreError):
            await store.connection.run("renew", [key], [token, store.lock_lease_ms])


class Writer:
    """One request's hold on a session: the state it started from, and its one commit."""

    def __init__(self, store: SessionStore, meta: SessionMeta, state: StateBlobs | None, token: str):
        self.store = store
        self.meta = meta
        self.state = state
        self._token = token
        self._done = False
        self.kept_as: tuple[int, str] | None = None  # (ttl, holder) its commit gives the session
        # (a function of the lock alone, not a method: a task whose frame held `self` would
        # make a reference cycle, keeping this writer and the state bytes it holds alive
        # until the cyclic garbage collector happened to run)
        self._renewer = asyncio.create_task(_keep_alive(store, store.keys.lock(meta.id), token))

    async def commit(
        self,
        n_tokens: int,
        *,
        snapshot: bytes | None = None,
        delta: bytes | None = None,
        segment: bytes = b"",
        tokens_hash: str = "",
    ) -> SessionMeta:
        """Commit version `meta.version + 1`, only if nobody committed since `begin`.

        Exactly one of `snapshot` (replaces the whole stored state) or `delta` (appended
        after the stored snapshot and deltas) is given; `segment` is appended to the
        transcript in the same step, and so are `kept_as`'s ttl and holder, when set (as
        `SessionStore.retain` sets them).
        """
        if self._done:
            raise RuntimeError("a writer commits at most once")
        if (snapshot is None) == (delta is None):
            raise ValueError("commit takes exactly one of snapshot= or delta=")
        s, sid = self.store, self.meta.id
        ttl, holder = self.kept_as or ("", "")
        mode, blob = ("snapshot", snapshot) if snapshot is not None else ("delta", delta)
        assert blob is not None
        args = [
            self.meta.version, int(n_tokens), self._token, mode, blob, new_commit_id(), segment,
            s.transcript_max_bytes, tokens_hash, ttl, holder,
        ]  # fmt: skip
        new = self.meta.version + 1
        what = f"committing version {new} of session {sid}"
        check = f"read the session (version {new - 1}: it was not committed; {new}: it was)"
        answer = fields(await s._run("commit", sid, args, what, check))
        if answer["status"] == b"missing":
            raise CommitConflict(sid, self.meta.version, None)
        if answer["status"] == b"conflict":
            raise CommitConflict(sid, self.meta.version, int(answer["version"]))
        self._done = True
        self._renewer.cancel()
        metrics.STATE_BYTES_WRITTEN.inc(len(blob))
        return SessionMeta.from_fields(sid, answer["meta"])

    async def release(self) -> bool:
        """Give up the lock (a no-op after a successful commit, which released it); whether
        this call gave it up (False: committed, or released before)."""
        self._renewer.cancel()
        if self._done:
            return False
        self._done = True
        # shielded: a cancelled request must still free the lock (else it waits out the lease)
        with contextlib.suppress(StoreError):
            await asyncio.shield(
                self.store.connection.run("release", [self.store.keys.lock(self.meta.id)], [self._token])
            )
        return True
