"""A Redis Cluster for tests: 3 masters and 3 replicas of redis-server on free loopback ports, stopped by PID.

`start` starts six empty nodes in cluster mode (AOF and log under the cluster's directory), joins them with
`redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes` and waits until every node says
`cluster_state:ok` and every one of the 16384 slots is served by a master with a replica. `stop` stops every node
it started, by PID, and removes the directory. `fail_over` SIGKILLs a master and waits until the cluster has
promoted its replica and serves every slot again: what the fault tests of a master lost under load start from;
`restart` brings the killed node back, as a replica of the master that took over. `move` starts moving a slot to
another master as `redis-cli --cluster reshard` does (`Move`: IMPORTING on the target, MIGRATING on the source), so a
test can hold the slot split, some keys moved and some not, for as long as it wants, then finish the move.

`Cluster(directory, masters=1, replicas=0)` (what `python -m bench cluster` compares with `masters=3, replicas=0`):
`redis-cli` creates no cluster of fewer than three masters, so those get their slots with `CLUSTER ADDSLOTSRANGE`
(an even share each) and meet the first; without replicas the wait is for every slot served by a master.

The cluster notices a dead master within NODE_TIMEOUT_MS (kept short here), then its replica wins the election.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from pipeline.cli.redis_bin import redis_binary
from tests.support.procs import free_port, wait_for
from tests.support.topology import Node

#: How long a node may not answer before the cluster counts it as failed (ms): a failover within a few seconds.
NODE_TIMEOUT_MS = 2000
SLOTS = 16384
MASTERS = 3
#: A cluster node also listens on its port plus this (the cluster bus).
BUS_OFFSET = 10000


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (port + BUS_OFFSET) is a port, and free too."""
    while True:
        port = free_port()
        if port + BUS_OFFSET > 65535:
            continue
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port + BUS_OFFSET))
            return port


def redis_cli() -> str:
    """The `redis-cli` (or Valkey's `valkey-cli`) beside the redis-server the tests start."""
    folder = Path(redis_binary()).parent
    for name in ("redis-cli", "valkey-cli"):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if found is None:
        raise RuntimeError(f"no redis-cli beside {redis_binary()} nor on PATH: needed to create a Redis Cluster")
    return found


@dataclass(frozen=True)
class Member:
    """One node as the cluster describes it (`CLUSTER NODES`)."""

    node_id: str
    port: int
    master: bool
    #: The master's node id, for a replica ('' for a master).
    master_id: str
    alive: bool


class Cluster:
    """Six redis-server nodes in cluster mode: three masters, each with one replica (or `masters` masters with
    `replicas` replicas each: what the cluster benchmark compares, 1 master against 3, no replicas)."""

    def __init__(self, directory: Path, masters: int = MASTERS, replicas: int = 1) -> None:
        if masters < MASTERS and replicas:
            raise ValueError(f"fewer than {MASTERS} masters (which redis-cli does not create) take no replicas")
        self.directory = directory
        self.replicas = replicas
        options = (
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-config-file",
            "nodes.conf",
        )
        self.nodes = [Node(directory / f"node-{i}", cluster_port(), options) for i in range(masters * (1 + replicas))]

    # --- start and stop ---------------------------------------------------------------------------------------

    def start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        if len(self.nodes) < MASTERS:
            self._assign_slots()
        else:
            argv = [redis_cli(), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
            argv += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            created = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
        wait_for(
            lambda: self.healthy(with_replicas=self.replicas > 0),
            30,
            0.1,
            what="cluster_state:ok and every slot served by a master (with a replica when it has them)",
        )
        return self

    def _assign_slots(self) -> None:
        """What `redis-cli --cluster create` does for fewer than three masters (which it refuses): each master
        takes an even share of the slots, then meets the first."""
        share = SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            end = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * share - 1
            node.client().execute_command("CLUSTER ADDSLOTSRANGE", i * share, end)
            if i:
                node.client().execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- what the clients see -----------------------------------------------------------------------------------

    @property
    def seeds(self) -> list[Node]:
        return [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]

    def url(self, scheme: str = "redis+cluster") -> str:
        """REDIS_URL for this cluster: every live node as a seed."""
        return f"{scheme}://" + ",".join(f"127.0.0.1:{node.port}" for node in self.seeds) + "/0"

    def client(self) -> RedisCluster:
        """A redis-py cluster client on this cluster (it follows MOVED and refreshes its slot map)."""
        seeds = [ClusterNode("127.0.0.1", node.port) for node in self.seeds]
        return RedisCluster(startup_nodes=seeds, socket_timeout=5, socket_connect_timeout=5)

    def node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)

    def members(self) -> list[Member]:
        """Every node as a live node sees the cluster (`CLUSTER NODES`)."""
        for node in self.seeds:
            with contextlib.suppress(redis.RedisError):
                return _parse_nodes(node.client().execute_command("CLUSTER NODES"))
        raise RuntimeError("no node of the cluster answers")

    def master_of(self, slot: int) -> Node:
        """The node serving `slot` now, as a live node answers `CLUSTER SLOTS`."""
        for node in self.seeds:
            with contextlib.suppress(redis.RedisError):
                for start, end, master, *_replicas in node.client().execute_command("CLUSTER SLOTS"):
                    if int(start) <= slot <= int(end):
                        return self.node(int(master[1]))
        raise RuntimeError(f"no live node names a master for slot {slot}")

    def replica_of(self, master: Node) -> Node:
        members = self.members()
        master_id = next(m.node_id for m in members if m.port == master.port)
        return self.node(next(m.port for m in members if m.master_id == master_id))

    def healthy(self, with_replicas: bool = True) -> bool:
        """Every live node says `cluster_state:ok`, and every slot is served by a master (with a replica)."""
        with contextlib.suppress(redis.RedisError):
            for node in self.seeds:
                if node.client().execute_command("CLUSTER INFO").get("cluster_state") != "ok":  # parsed by redis-py
                    return False
            covered = 0
            for start, end, _master, *replicas in self.seeds[0].client().execute_command("CLUSTER SLOTS"):
                if with_replicas and not replicas:
                    return False
                covered += int(end) - int(start) + 1
            return covered == SLOTS
        return False

    def flush(self) -> None:
        """FLUSHALL on every live master (the replicas follow): what a test that starts from an empty cluster calls,
        since the cluster is shared by the tests of one process."""
        for node in self.seeds:
            with contextlib.suppress(redis.RedisError):
                if node.client().execute_command("ROLE")[0] in (b"master", "master"):
                    node.client().flushall()

    # --- faults ---------------------------------------------------------------------------------------------------

    def fail_over(self, master: Node, timeout: float = 30) -> Node:
        """SIGKILL `master` (by PID) and wait until its replica is a master serving its slots and every live node
        says `cluster_state:ok`; returns the promoted node."""
        replica = self.replica_of(master)
        master.kill()
        master.proc = None

        def promoted() -> bool:
            with contextlib.suppress(redis.RedisError):
                role = replica.client().execute_command("ROLE")[0]
                return role in (b"master", "master") and self.healthy(with_replicas=False)
            return False

        wait_for(promoted, timeout, 0.1, what=f"the replica on port {replica.port} promoted")
        return replica

    def restart(self, node: Node, timeout: float = 30) -> None:
        """Start a killed `node` again (its nodes.conf kept): it rejoins as a replica of the master that took over;
        wait until every slot has a replica again."""
        node.start()
        wait_for(self.healthy, timeout, 0.1, what=f"the node on port {node.port} back as a replica")

    def node_id(self, port: int) -> str:
        return next(m.node_id for m in self.members() if m.port == port)

    def move(self, slot: int, target_port: int) -> Move:
        """Start moving `slot` to the master on `target_port`: IMPORTING on the target, then MIGRATING on the
        source; no key moves yet (`Move.migrate`, `Move.finish`)."""
        source, target = self.master_of(slot), self.node(target_port)
        source_id, target_id = self.node_id(source.port), self.node_id(target.port)
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        return Move(self, slot, source, target, target_id)


@dataclass
class Move:
    """A slot on its way from the master `source` to the master `target` (`Cluster.move`)."""

    cluster: Cluster
    slot: int
    source: Node
    target: Node
    target_id: str
    moved: int = 0

    def migrate(self, names: list[str]) -> None:
        """MIGRATE the keys `names` (those the source still has) to the target, in one call."""
        there = [name for name in names if self.source.client().exists(name)]
        if there:
            self.source.client().execute_command("MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *there)
            self.moved += len(there)

    def remaining(self) -> list[str]:
        """The keys of the slot the source still has."""
        found = self.source.client().execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 100)
        return [name.decode() if isinstance(name, bytes) else str(name) for name in found]

    def finish(self, pause_s: float = 0.0) -> None:
        """MIGRATE the rest a key at a time (`pause_s` between two), then SETSLOT NODE on the target, the source and
        every other master: the target serves the slot."""
        while batch := self.remaining()[:1]:
            self.migrate(batch)
            time.sleep(pause_s)
        masters = {m.port for m in self.cluster.members() if m.master and m.alive}
        others = (self.cluster.node(port) for port in masters - {self.source.port, self.target.port})
        for node in (self.target, self.source, *others):
            node.client().execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)


def _parse_nodes(reply: dict[str, dict[str, object]]) -> list[Member]:
    """`CLUSTER NODES` as redis-py parses it: address -> the node's fields."""
    members = []
    for address, fields in reply.items():
        flags = str(fields["flags"]).split(",")
        master_id = "" if fields["master_id"] == "-" else str(fields["master_id"])
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        members.append(Member(str(fields["node_id"]), port, "master" in flags, master_id, "fail" not in flags))
    return members
