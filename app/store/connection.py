"""Where Redis is, and the one client every store room shares.

Where the sessions live is one URL (`Settings.redis_url`, parsed by `parse_redis_url`):

    redis://[user:pass@]host:port/db            one server (also rediss://, unix://: redis-py's
                                                 own URL forms)
    redis+cluster://[user:pass@]host:port[,host:port...]
                                                 a Redis Cluster; the listed nodes are seeds, the
                                                 client discovers the rest (port default 6379)
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]
                                                 the primary that these Sentinels name `service`,
                                                 asked again for each new connection and about once
                                                 a second in use, so a failover needs no restart
                                                 (port default 26379)

Credentials in a Cluster or Sentinel URL are the Redis servers'; Sentinels are asked
without them. Every form gets the same bounded pool, timeouts and client name. A dead or
unreachable Redis (or, in a Cluster, the primary holding a key's slot) surfaces as
`StoreUnavailable` within the socket timeout, never as a hang.

A command that timed out may still be queued in Redis: a stalled Redis runs it when the
stall ends. So the client retries a command once after a lost connection, never after a
timeout, and a write (`scripts.WRITES`) that got no answer is `OutcomeUnknown`, never
"failed": each such write recognises its own first run, so the retry answers truly.

`Connection` runs the scripts (app/store/scripts.py) and watches Redis's memory for the
storage guard, off the requests' path. It knows no key schema: the rooms beside it do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    ClusterError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import metrics

from . import scripts
from .types import OutcomeUnknown, StoreUnavailable

log = logging.getLogger("recur.store")

CLIENT_NAME = "recur"  # every connection's CLIENT SETNAME, to find a replica's in CLIENT LIST
MEMORY_PERIOD = 0.5  # seconds between readings of Redis's memory (the storage guard's)


@dataclass(frozen=True)
class RedisTarget:
    """A parsed `Settings.redis_url` (the forms are in the module docstring)."""

    kind: Literal["server", "cluster", "sentinel"]
    nodes: tuple[tuple[str, int], ...] = ()  # Cluster seeds, or the Sentinels
    service: str = ""  # Sentinel: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """Raises ValueError, naming the expected form, for a malformed Cluster or Sentinel URL.
    Any other scheme is one server's URL, left for redis-py to parse."""
    scheme, sep, rest = url.partition("://")
    kind = {"redis+cluster": "cluster", "redis+sentinel": "sentinel"}.get(scheme.lower())
    if not sep or kind is None:
        return RedisTarget("server")
    form = {
        "cluster": "redis+cluster://[user:password@]host:port[,host:port...]",
        "sentinel": "redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]",
    }[kind]
    netloc, _, path = rest.partition("/")
    path = path.partition("?")[0].strip("/")
    creds, _, hosts = netloc.rpartition("@")
    user, _, password = creds.partition(":")
    default_port = 6379 if kind == "cluster" else 26379
    nodes = []
    for node in filter(None, hosts.split(",")):
        host, colon, port = node.rpartition(":")
        if not colon or "]" in port:  # no port ("[::1]" ends in no port)
            host, port = node, ""
        try:
            nodes.append((unquote(host.strip("[]")), int(port) if port else default_port))
        except ValueError:
            raise ValueError(f"bad port in {node!r}: the Redis URL's form is {form}") from None
    if not nodes or not all(h for h, _ in nodes):
        raise ValueError(f"no host in the Redis URL: its form is {form}")
    parts = path.split("/") if path else []
    if kind == "cluster":
        if parts not in ([], ["0"]):  # a Cluster has database 0 only
            raise ValueError(f"a Redis Cluster has database 0 only: the URL's form is {form}")
        service, db = "", 0
    else:
        if not 1 <= len(parts) <= 2 or not parts[0] or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"a Sentinel URL names the service (and may give a db): its form is {form}")
        service, db = unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget(
        kind,  # type: ignore[arg-type]
        tuple(nodes),
        service,
        db,
        username=unquote(user) or None,
        password=unquote(password) or None,
    )


class NotSent(RedisConnectionError):
    """No connection to send a command on: none came free in time, or none could be opened
    (Redis down, no primary known). The command never left, so nothing of it ran."""


PIECE = 512 * 1024  # bytes: the most of one command the event loop writes before it yields


class _InPieces:
    """A connection that writes a large command (a SmolLM2 state is up to 47 MB) a piece at a
    time, yielding to the event loop between pieces. redis-py hands the whole command to the
    transport at once, which (Python < 3.12) joins it, slices and buffers it: three copies of
    47 MB, about 0.12 s in which no other request's token went out (issue 39's state loads).
    A command cut short by a timeout or a lost connection is as incomplete as before: Redis
    never runs a command it has not wholly read."""

    _writer: asyncio.StreamWriter | None

    async def _send_packed_command(self, command: Any) -> None:
        command = list(command)
        writer = self._writer
        if sum(map(len, command)) <= PIECE or writer is None:
            return await super()._send_packed_command(command)  # type: ignore[misc]
        for part in command:
            view = memoryview(part)
            for at in range(0, len(view), PIECE):
                if writer.transport.is_closing():
                    raise RedisConnectionError("Connection closed by the server while writing")
                writer.write(view[at : at + PIECE])
                await writer.drain()
                await asyncio.sleep(0)  # (drain returns at once while the socket takes it all)


def _in_pieces(cls: type) -> type:
    """`cls`, a redis-py connection class, writing large commands in pieces (`_InPieces`):
    one subclass per class."""
    if not issubclass(cls, _InPieces):
        cls = _IN_PIECES.setdefault(cls, type(f"InPieces{cls.__name__}", (_InPieces, cls), {}))
    return cls


_IN_PIECES: dict[type, type] = {}


class _Handout:
    """A pool whose failure to hand out a connection says so (NotSent): redis-py raises the
    same errors for a connection refused before a command was sent as for one lost after."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise NotSent(str(exc)) from exc


class _Pool(_Handout, aioredis.BlockingConnectionPool):
    """One server's bounded pool: past `max_connections` busy ones, a command waits for a
    free connection (up to the timeout)."""


class _SentinelPool(_Handout, SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The Sentinel-managed primary's connections in the same bounded pool as one server's:
    past `max_connections` busy ones, a command waits for a free one. Each new connection
    asks the Sentinels where the primary is, so after a failover it finds the new one."""

    async def release(self, connection: Any) -> None:
        # a connection that was busy when the primary moved still reaches the old one
        # (redis-py drops only the idle ones): drop it too, so its next use asks again
        if self.master_address is not None and (connection.host, connection.port) != self.master_address:
            await connection.disconnect()
        await super().release(connection)


# errors that mean "Redis, or the Cluster node holding the key, cannot serve now". The
# cluster ones: CLUSTERDOWN, a slot no live primary serves, a slot being moved (TRYAGAIN)
_UNREACHABLE = (
    RedisConnectionError,  # also Sentinel's MasterNotFoundError
    RedisTimeoutError,
    OSError,
    ClusterError,
    SlotNotCoveredError,
    TryAgainError,
)


def _unsent(exc: Exception) -> bool:
    """Whether `exc` says the command never reached Redis (no connection to send it on), or
    that Redis refused it unrun (a Cluster's refusal)."""
    cause = exc.__cause__ if isinstance(exc, RedisClusterException) else None
    refusals = (NotSent, MasterNotFoundError, ClusterError, SlotNotCoveredError, TryAgainError)
    return isinstance(exc, refusals) or isinstance(cause, refusals)


def unavailable(exc: Exception) -> StoreUnavailable | None:
    """The StoreUnavailable a Redis error stands for, or None when it is some other error."""
    if isinstance(exc, RedisOutOfMemoryError) or (isinstance(exc, RedisResponseError) and "OOM" in str(exc)):
        # maxmemory reached under `noeviction`: the script's first write was refused, so
        # nothing was written; the session stays as it was
        return StoreUnavailable("Redis is full (maxmemory reached): nothing was written")
    # the cluster client's "no node answered" carries the connection error it last saw
    cause = exc.__cause__ if isinstance(exc, RedisClusterException) else None
    if isinstance(exc, _UNREACHABLE) or isinstance(cause, _UNREACHABLE):
        return StoreUnavailable(f"Redis is unavailable: {exc}")
    return None


class Connection:
    """The client for one `Settings.redis_url`, shared by the session and tenant rooms."""

    def __init__(self, url: str, *, timeout: float, max_connections: int, max_waiting: int = 0):
        self.timeout = timeout
        target = parse_redis_url(url)
        self._sentinel: Sentinel | None = None
        self._next_ask = 0.0  # Sentinel: when to ask again where the primary is
        self._asking: asyncio.Task[None] | None = None
        # a Cluster only: one permit per command in flight (see `permit`)
        self._permits = asyncio.Semaphore(max_connections) if target.kind == "cluster" else None
        self.redis = self._connect(url, target, max_connections, timeout)
        # the blocking reads' own pool (`wait`): a reader waiting on a stream holds a
        # connection for up to `timeout`, and must never hold one the requests need
        self._waiting = self._connect(url, target, max_waiting or max_connections, 2 * timeout)
        self.scripts: dict[str, AsyncScript] = {
            n: self.redis.register_script(scripts.source(n)) for n in scripts.SCRIPTS
        }
        self.memory_full = False  # the storage guard's last reading (`watch_memory`)
        self._watching: asyncio.Task[None] | None = None

    def _connect(
        self, url: str, target: RedisTarget, max_connections: int, read_timeout: float
    ) -> aioredis.Redis | RedisCluster:
        """A client for `target`, with the same timeouts, retry and client name in every form
        (`read_timeout`: the socket's, longer for a blocking read's pool)."""
        timeout = self.timeout
        common: dict[str, Any] = dict(
            socket_timeout=read_timeout,
            socket_connect_timeout=timeout,
            # (a lost connection only: never a timeout, see the module)
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=False,
            client_name=CLIENT_NAME,
        )
        if target.kind == "cluster":
            # max_connections is per node here, and past it the client fails instead of
            # waiting, so the permits keep the bound (and the wait) of a blocking pool;
            # require_full_coverage=False: a shard without a primary must not stop the
            # client from serving every other slot
            cluster = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                require_full_coverage=False,
                max_connections=max_connections,
                username=target.username,
                password=target.password,
                **common,
            )
            # (its nodes' connections, those it finds later too, are made from these kwargs)
            made = cluster.nodes_manager.connection_kwargs
            made["connection_class"] = _in_pieces(made.get("connection_class", aioredis.Connection))
            for node in cluster.nodes_manager.startup_nodes.values():
                node.connection_class = made["connection_class"]
            return cluster
        if target.kind == "sentinel":
            self._sentinel = self._sentinel or Sentinel(
                list(target.nodes),
                sentinel_kwargs=dict(socket_timeout=timeout, socket_connect_timeout=timeout),
            )
            client = self._sentinel.master_for(
                target.service,
                connection_pool_class=_SentinelPool,
                max_connections=max_connections,
                timeout=timeout,
                db=target.db,
                username=target.username,
                password=target.password,
                **common,
            )
            client.connection_pool.connection_class = _in_pieces(client.connection_pool.connection_class)
            return client
        # one server, a bounded pool: past `max_connections` busy ones, a command waits for
        # a free connection (up to `timeout`, then StoreUnavailable) instead of opening another
        pool = _Pool.from_url(url, max_connections=max_connections, timeout=timeout, **common)
        pool.connection_class = _in_pieces(pool.connection_class)
        return aioredis.Redis.from_pool(pool)

    async def run(self, name: str, keys: list[str], args: list[Any], what: str = "", check: str = "") -> Any:
        """Run script `name` (app/store/lua/NAME.lua), its errors as StoreUnavailable where
        Redis cannot serve now; a write (`scripts.WRITES`) sent without an answer raises
        OutcomeUnknown, naming `what` it does and how to `check` whether it happened."""
        script = self.scripts[name]
        self._follow_primary()
        try:
            async with self.permit():
                if self._permits is None:
                    return await script(keys=keys, args=args)
                # a Cluster: a script missing on the key's node is loaded there alone (EVAL
                # caches it); the Script object's SCRIPT LOAD goes to every primary, and so
                # would fail for every slot while any one primary is down
                try:
                    return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
                except NoScriptError:
                    return await self.redis.eval(script.script, len(keys), *keys, *args)  # type: ignore[arg-type]
        except Exception as exc:
            err = unavailable(exc)
            if self._sentinel is not None and isinstance(exc, RedisResponseError) and "READONLY" in str(exc):
                # a failover demoted the server these connections reach (a script's write
                # fails as a plain error, which redis-py does not take for a failover):
                # drop the idle ones, so the next command asks the Sentinels again
                assert isinstance(self.redis, aioredis.Redis)
                await self.redis.connection_pool.disconnect(inuse_connections=False)
                err = StoreUnavailable(f"Redis is unavailable: the primary became a replica ({exc})")
            if err is None:
                raise
            metrics.REDIS_ERRORS.inc()
            if name in scripts.WRITES and not isinstance(exc, RedisResponseError) and not _unsent(exc):
                err = OutcomeUnknown(what or f"a write ({name})", check or "read what it writes")
            raise err from None

    async def wait(self, key: str, after: str, block: float) -> bool:
        """Wait up to `block` seconds (under the timeout) for an entry after id `after` in
        stream `key` (`XREAD BLOCK`, on the blocking reads' own pool): whether one came.
        With no connection of that pool free in time, or Redis away, it says no after the
        wait: the caller reads again and finds out."""
        block = min(block, self.timeout)  # (its socket's timeout is twice that)
        try:
            return bool(await self._waiting.xread({key: after}, count=1, block=max(1, int(block * 1000))))
        except Exception as exc:
            if unavailable(exc) is None and not isinstance(exc, RedisResponseError):
                raise
            await asyncio.sleep(min(block, 0.05))  # (never a busy loop while Redis is away)
            return False

    def _follow_primary(self) -> None:
        """Sentinel: ask the Sentinels where the primary is, at most once a second, off the
        command's path. A failover that leaves the old primary running (SENTINEL FAILOVER,
        a partition) demotes it only when Sentinel reconfigures it, seconds later; until
        then, open connections would go on writing there, and the writes would be lost.
        When the answer changes, the pool drops its connections to the old primary."""
        now = time.monotonic()
        if self._sentinel is None or now < self._next_ask:
            return
        self._next_ask = now + 1.0
        if self._asking is None or self._asking.done():
            self._asking = asyncio.create_task(self._ask_sentinels())

    async def _ask_sentinels(self) -> None:
        assert isinstance(self.redis, aioredis.Redis)
        pool = self.redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        with contextlib.suppress(RedisError, OSError):  # the commands themselves will tell
            await pool.get_master_address()

    @contextlib.asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        """A Cluster's stand-in for the blocking pool: a command waits (up to the timeout)
        for one of `max_connections` permits, so no node is ever asked for more."""
        if self._permits is None:
            yield
            return
        try:
            await asyncio.wait_for(self._permits.acquire(), self.timeout)
        except TimeoutError:
            raise NotSent("No connection available.") from None  # (as redis-py's pool says it)
        try:
            yield
        finally:
            self._permits.release()

    async def ping(self) -> None:
        """Redis answers. For a Cluster: some primary answers. One dead primary makes only
        its slots' sessions fail (with StoreUnavailable); it must not make the replica
        unready for every other session, as PING to every primary would."""
        try:
            if isinstance(self.redis, RedisCluster):
                await self._ping_cluster(self.redis)
            else:
                await self.redis.ping()
        except Exception as exc:
            err = unavailable(exc)
            if err is None:
                raise
            raise err from None

    async def _ping_cluster(self, cluster: RedisCluster) -> None:
        async def one(node: ClusterNode) -> None:
            async with self.permit():
                await cluster.execute_command("PING", target_nodes=node)

        async with self.permit():  # (once: it learns the nodes and their slots)
            await cluster.initialize()
        answers = await asyncio.gather(*map(one, cluster.get_primaries()), return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if len(errors) == len(answers):
            raise errors[0] if errors else RedisConnectionError("the Cluster has no primary")

    async def close(self) -> None:
        for task in (self._asking, self._watching):
            if task is not None:
                task.cancel()
        await self.redis.aclose()
        await self._waiting.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    # -- the storage guard's reading ------------------------------------------------------------
    def watch_memory(self, fraction: float, period: float = MEMORY_PERIOD) -> None:
        """Read, every `period` seconds in the background, whether Redis's used memory has
        passed `fraction` of its maxmemory (`memory_full`; never, without a maxmemory): a
        request reads the last answer and never waits for INFO."""
        if self._watching is None:
            self._watching = asyncio.create_task(self._watch_memory(fraction, period))

    async def _watch_memory(self, fraction: float, period: float) -> None:
        while True:
            try:
                nodes = await self._memory_info()
            except StoreUnavailable:
                pass  # (the requests will tell; the last reading stands)
            else:
                self.memory_full = any(
                    int(n.get("maxmemory", 0)) > 0
                    and int(n.get("used_memory", 0)) >= fraction * int(n["maxmemory"])
                    for n in nodes
                )
            await asyncio.sleep(period)

    async def _memory_info(self) -> list[dict]:
        """INFO memory of the server, or of every primary of a Cluster that answers (a dead
        one is skipped: its own sessions fail on their own)."""
        try:
            async with self.permit():
                if not isinstance(self.redis, RedisCluster):
                    return [await self.redis.info("memory")]
                out = []
                for node in self.redis.get_primaries():
                    with contextlib.suppress(Exception):
                        out.append(await self.redis.info("memory", target_nodes=node))
                return out
        except Exception as exc:
            raise unavailable(exc) or exc from None
