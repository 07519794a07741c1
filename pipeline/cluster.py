"""Clients on a Redis Cluster (`REDIS_URL=redis+cluster://...`, `pipeline.config.cluster`): redis-py's
`RedisCluster`, synchronous and asyncio, and where each queue lives on it.

A cluster client asks a seed for the slot map and sends each command to the master serving its key's slot; it
follows MOVED and ASK and reloads the map after a failover or a resharding. A pipeline without MULTI may mix slots
(redis-py splits it by node); a MULTI, a script or an MGET may not (CROSSSLOT), which is why every key of a queue
carries the queue's hash tag (`pipeline.queues.keys`, docs/redis-layout.md).

`pipeline.broker` hands these out in place of its single-Redis clients when the broker URL names a cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio.cluster
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from pipeline.config import cluster, get_settings
from pipeline.queues import keys

#: The process's shared client (`shared`): thread-safe, one connection pool per node.
_shared: list[RedisCluster] = []
_lock = threading.Lock()
#: Longest wait for one node's answer on the shared client (seconds): an operator's read, an API call.
SHARED_TIMEOUT_S = 10.0


def options(timeout: float) -> dict[str, Any]:
    """What a cluster client of the broker URL is given: its credentials, TLS and `timeout` (connect and answer)."""
    settings = get_settings()
    parsed = cluster.parse(settings.broker_url)
    found: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if parsed.username is not None:
        found["username"] = parsed.username
    if parsed.password is not None:
        found["password"] = parsed.password
    if parsed.tls:
        found.update(ssl=True, ssl_cert_reqs=settings.redis_tls_cert_reqs)
        if settings.redis_tls_ca_file is not None:
            found["ssl_ca_certs"] = str(settings.redis_tls_ca_file)
    return found


def _seeds() -> tuple[tuple[str, int], ...]:
    return cluster.parse(get_settings().broker_url).seeds


def client(timeout: float, decode_responses: bool = False) -> RedisCluster:
    """A cluster client of its own on the broker's cluster, with `timeout` for connect and answer (replies as str
    with `decode_responses`, as celery-redbeat reads them)."""
    seeds = [ClusterNode(host, port) for host, port in _seeds()]  # type: ignore[no-untyped-call]  # redis-py: untyped
    return RedisCluster(startup_nodes=seeds, decode_responses=decode_responses, **options(timeout))


def async_client(timeout: float, max_connections: int) -> redis.asyncio.cluster.RedisCluster:
    """An asyncio cluster client of its own, at most `max_connections` connections per node."""
    seeds = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in _seeds()]
    return redis.asyncio.cluster.RedisCluster(startup_nodes=seeds, max_connections=max_connections, **options(timeout))


def shared() -> RedisCluster:
    """The process's cluster client, made on first use (what `pipeline.broker.broker_redis` yields on a cluster)."""
    if not _shared:
        with _lock:
            if not _shared:
                _shared.append(client(SHARED_TIMEOUT_S))
    return _shared[0]


def reset() -> None:
    """Close and forget the shared client (tests; a process that changed its settings)."""
    with _lock:
        while _shared:
            _shared.pop().close()


def node_of(client: redis.Redis | RedisCluster, key: str) -> redis.Redis:
    """A client of the master serving `key`'s slot now: where a WAIT for that key's writes is sent."""
    if not isinstance(client, RedisCluster):
        return client
    node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]  # redis-py: untyped
    found: redis.Redis = client.get_redis_connection(node)
    return found


@dataclass(frozen=True)
class Placement:
    """Where a queue lives on the cluster: its slot and the master serving it (`host:port`)."""

    queue: str
    slot: int
    master: str


def placement(client: RedisCluster, queue: str) -> Placement:
    """The slot of `queue`'s hash tag and the master serving it now, from `client`'s slot map."""
    slot = key_slot(keys.tag(queue).encode())
    node = client.nodes_manager.get_node_from_slot(slot)
    return Placement(queue, slot, f"{node.host}:{node.port}")


def masters_info(client: RedisCluster, section: str) -> dict[str, dict[str, Any]]:
    """`INFO <section>` of every master, by `host:port`."""
    replies: dict[str, dict[str, Any]] = client.info(section, target_nodes=RedisCluster.PRIMARIES)
    return replies


def get_many(client: Any, names: Sequence[str]) -> list[Any]:
    """GET of each of `names`, in order: one MGET on a single Redis; on a cluster one MGET per slot, sent to each
    slot's master (redis-py's `mget_nonatomic`: names in several slots would be refused as CROSSSLOT in one MGET)."""
    if not names:
        return []
    if isinstance(client, RedisCluster):
        return list(client.mget_nonatomic(list(names)))
    return list(client.mget(list(names)))
