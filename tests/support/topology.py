"""A replicated Redis for tests: a primary, a replica and three Sentinels on free loopback ports, stopped by PID.

Sentinel is tuned to fail over within seconds (`down-after-milliseconds` 2000, a short `failover-timeout`, quorum 2).
Every node keeps its data (AOF) and log under the topology's directory. `kill_primary` SIGKILLs the current primary,
`wait_promoted` waits until every Sentinel names another, and `restart_as_replica` brings the killed node back
as a replica of the new primary (what a supervisor restarting it with the new role does), so writes that wait for a
replica (REDIS_WAIT_REPLICAS=1) can succeed again.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pipeline.cli.redis_bin import redis_binary
from tests.support.procs import free_port, stop_process, wait_for

MASTER_NAME = "pipemaster"
DOWN_AFTER_MS = 2000
FAILOVER_TIMEOUT_MS = 3000


def _client(port: int, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout)


def _answers(port: int) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(_client(port).ping())
    return False


def start_sentinel(conf: Path) -> subprocess.Popen[bytes]:
    """A Sentinel on config file `conf` (it rewrites it), in its own session, run from the file's directory."""
    argv = [redis_binary(), str(conf), "--sentinel"]
    devnull = subprocess.DEVNULL
    return subprocess.Popen(argv, cwd=conf.parent, stdout=devnull, stderr=devnull, start_new_session=True)


@dataclass
class Node:
    """One redis-server (`role`: a name for its directory and log), with the arguments it starts with."""

    directory: Path
    port: int = field(default_factory=free_port)
    options: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> Node:
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction"]
        argv += ["--repl-diskless-sync-delay", "0"]  # a replica (re)syncs at once, not 5 s later
        argv += ["--logfile", str(self.directory / "redis.log"), *self.options, *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _answers(self.port), 15, what=f"redis-server on port {self.port}")
        return self

    def client(self) -> redis.Redis:
        return _client(self.port, timeout=5)

    def kill(self) -> None:
        """SIGKILL by PID: no shutdown, no last AOF write, as a crashed host."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


class Topology:
    """A primary, a replica and three Sentinels monitoring them as `MASTER_NAME`."""

    def __init__(self, directory: Path, *, min_replicas_to_write: int = 0, min_replicas_max_lag: int = 10) -> None:
        self.directory = directory
        options: tuple[str, ...] = ()
        if min_replicas_to_write:
            options = (
                "--min-replicas-to-write",
                str(min_replicas_to_write),
                "--min-replicas-max-lag",
                str(min_replicas_max_lag),
            )
        self.nodes = [Node(directory / "node-a", options=options), Node(directory / "node-b", options=options)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    # --- start and stop ---------------------------------------------------------------------------------------

    def start(self) -> Topology:
        primary, replica = self.nodes
        primary.start()
        replica.start("--replicaof", "127.0.0.1", str(primary.port))
        wait_for(lambda: self._synced(replica), 15, 0.1, what="the replica to sync")
        for port in self.sentinel_ports:
            self.sentinels.append(self._start_sentinel(port, primary.port))
        wait_for(self._sentinels_ready, 30, 0.2, what="three Sentinels that know each other and the replica")
        return self

    def _start_sentinel(self, port: int, primary_port: int) -> subprocess.Popen[bytes]:
        directory = self.directory / f"sentinel-{port}"
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\nlogfile {directory / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        proc = start_sentinel(conf)
        wait_for(lambda: _answers(port), 15, what=f"Sentinel on port {port}")
        return proc

    def stop(self) -> None:
        for proc in self.sentinels:
            stop_process(proc)
        self.sentinels = []
        for node in self.nodes:
            node.stop()

    # --- what the clients see -----------------------------------------------------------------------------------

    def url(self, db: int = 0) -> str:
        """The broker URL: every Sentinel, `;`-separated, as REDIS_URL takes it."""
        return ";".join(f"sentinel://127.0.0.1:{port}/{db}" for port in self.sentinel_ports)

    def env(self, db: int = 0) -> dict[str, str]:
        return {"REDIS_URL": self.url(db), "REDIS_SENTINEL_MASTER": MASTER_NAME}

    def beat_env(self, entry: str, key: str, every: float, wait_timeout_ms: int) -> dict[str, str]:
        """Settings for processes on this topology whose writes a replica confirms (REDIS_WAIT_REPLICAS=1), with a
        beat that sends `test.ledger` {key} every `every` seconds as `entry`, its lock short (6 s)."""
        schedule = {entry: {"task": "test.ledger", "every": every, "payload": {"key": key}}}
        return {
            **self.env(),
            "REDIS_WAIT_REPLICAS": "1",
            "REDIS_WAIT_TIMEOUT_MS": str(wait_timeout_ms),
            "BEAT_SCHEDULE": json.dumps(schedule),
            "BEAT_LOCK_TIMEOUT": "6",
            "BEAT_MAX_LOOP_INTERVAL": "1",
        }

    def master_port(self, sentinel_port: int) -> int | None:
        """The primary's port as one Sentinel names it (None: that Sentinel does not answer)."""
        with contextlib.suppress(redis.RedisError):
            addr = _client(sentinel_port).sentinel_get_master_addr_by_name(MASTER_NAME)
            return int(addr[1]) if addr else None
        return None

    def primary(self, agreed: int = 2) -> Node:
        """The node at least `agreed` Sentinels (a majority by default) name as primary."""
        ports = [self.master_port(port) for port in self.sentinel_ports]
        for node in self.nodes:
            if ports.count(node.port) >= agreed:
                return node
        raise RuntimeError(f"no primary named by a majority of Sentinels: {ports}")

    def _synced(self, replica: Node) -> bool:
        with contextlib.suppress(redis.RedisError):
            info = _client(replica.port).info("replication")
            return info.get("master_link_status") == "up"
        return False

    def _sentinels_ready(self) -> bool:
        with contextlib.suppress(redis.RedisError):
            for port in self.sentinel_ports:
                client = _client(port)
                if len(client.sentinel_sentinels(MASTER_NAME)) < 2:
                    return False
                replicas = client.sentinel_slaves(MASTER_NAME)
                if not any(r.get("is_slave") and not r.get("is_sdown") for r in replicas):
                    return False
            return True
        return False

    # --- faults ---------------------------------------------------------------------------------------------------

    def kill_primary(self) -> tuple[Node, float]:
        """SIGKILL the current primary; the node and the time (`time.monotonic()`) of the kill."""
        node = self.primary()
        node.kill()
        return node, time.monotonic()

    def wait_promoted(self, old: Node, timeout: float = 30) -> Node:
        """Wait until every Sentinel names a primary other than `old`, and that node answers as one. (A Sentinel still
        on the old configuration may turn `old`, restarted as a replica, back into a primary.)"""

        def promoted() -> Node | None:
            with contextlib.suppress(RuntimeError, redis.RedisError):
                node = self.primary(agreed=len(self.sentinel_ports))
                if node is not old and _client(node.port).info("replication").get("role") == "master":
                    return node
            return None

        found = wait_for(promoted, timeout, 0.05, what="a replica promoted by the Sentinels")
        assert isinstance(found, Node)
        return found

    def restart_as_replica(self, node: Node, primary: Node) -> None:
        """Start the killed `node` again as a replica of `primary`, and wait until it has synced."""
        node.start("--replicaof", "127.0.0.1", str(primary.port))
        wait_for(lambda: self._synced(node), 20, 0.1, what="the restarted node to sync")
