"""A consumer on the worker transport that a test drives itself: one job published on a queue of its own, delivered."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu import Connection, Consumer, Exchange, Queue

from pipeline.delivery import fetch, transport
from pipeline.lua import source
from tests.support.procs import RedisServer, wait_for


@contextmanager
def one_delivered(redis: RedisServer, leases: Any, prefix: str) -> Iterator[tuple[Connection, Any, Any]]:
    """A connection on the worker transport bound to `leases` consuming a queue of its own (prefetch 3, the fetch
    script loaded), with one job published there and delivered: (connection, channel, message)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, "direct"), name)
    redis.client().script_load(source(fetch.FETCH))
    got: list[Any] = []
    with Connection(redis.url, transport=transport.bound(leases)) as conn:
        conn.Producer(conn.channel()).publish({"job": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        channel = conn.channel()
        channel.basic_qos(0, 3, False)
        Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)]).consume()
        wait_for(lambda: conn.drain_events(timeout=1) or got, 10, 0, what="the job's delivery")
        [message] = got
        yield conn, channel, message
