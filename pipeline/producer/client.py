"""One Redis client per process on the broker, reused by every publish of the process (thread-safe).

kombu builds a new redis-py client for each message it publishes. Here the client comes from a kombu
connection the process keeps for itself, so it carries the broker's own options (TLS, Sentinel, socket
timeouts, health checks); its connection pool hands each thread its own socket. A forked child builds its
own (the parent's sockets are never shared), keyed by process id. On a Redis Cluster it is the process's cluster
client, which sends each command to the master serving its key's slot.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import redis

from pipeline import cluster
from pipeline.celery_app import get_app
from pipeline.queues import keys

_lock = threading.Lock()
#: process id → (kombu connection kept open, its client)
_clients: dict[int, tuple[Any, redis.Redis]] = {}


def producer_redis() -> redis.Redis:
    """The process's Redis client on the broker (built on first use; raises if Redis is unreachable then)."""
    if keys.clustered():  # kombu cannot talk to a cluster: the process's cluster client (`pipeline.cluster`)
        return cast("redis.Redis", cluster.shared())
    pid = os.getpid()
    held = _clients.get(pid)
    if held is not None:
        return held[1]
    with _lock:
        if pid not in _clients:
            _clients.clear()  # a parent's entry after a fork: dropped, never closed (its sockets are the parent's)
            connection = get_app().connection_for_write()
            channel: Any = connection.default_channel  # kombu's Redis channel (StdChannel in the stubs)
            with channel.conn_or_acquire() as client:  # a client on the channel's own pool
                _clients[pid] = (connection, client)
        return _clients[pid][1]
