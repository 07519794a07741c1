"""Read-only views of the Redis broker, a Redis client configured exactly like it, and its URL fit to show.

Queue depth on Redis is the sum of `LLEN` over the queue's key and its priority sub-queue keys
(`<queue>\\x06\\x16<priority>`); jobs delivered but not acknowledged sit in kombu's `unacked` hash.
The client comes from the app's broker connection pool, so TLS and Sentinel settings apply as they do
to Celery itself.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.config.celery import is_sentinel
from pipeline.constants import (
    DEAD_LETTER_QUEUE,
    HEADER_PUBLISHED_AT,
    PRIORITY_SEPARATOR,
    PRIORITY_STEPS,
    UNACKED_KEY,
    WORK_QUEUES,
)
from pipeline.errors import NotReplicated

#: `scheme://user:` of a URL with a password, and the password (up to the `@`); never across whitespace.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/@:]*:)[^\s/@]+@")


def redact_url(text: str, mask: str = "***") -> str:
    """`text` with the password of every URL in it replaced by `mask` (`redis://:***@host:6379/0`).

    For messages, banners and logs that show the broker URL (or any text that may hold one); the user
    name, host and database stay, so the URL still says where it points.
    """
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{mask}@", text)


@contextmanager
def broker_redis() -> Iterator[redis.Redis]:
    """A redis-py client on the broker, from the app's connection pool.

    Always a client on the channel's plain pool (`Channel.conn_or_acquire`), never the channel's own `client`:
    that one is kombu's polling client, and once a pooled connection has consumed (a control command waiting
    for replies registers it for BRPOP) it is pinned to one socket with a BRPOP reply still due, so the next
    command would read the previous reply. The plain pool's sockets are checked for unread data (redis-py's
    `ConnectionPool.get_connection`).
    """
    # celery-types calls `get_app().pool` a ProducerPool; at run time it is the broker's connection pool.
    pool: Any = get_app().pool
    with pool.acquire(block=True, timeout=10) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as client:
            yield client


def direct_redis(timeout: float) -> redis.Redis | None:
    """A client of its own on the broker with short timeouts (`timeout`: connect and answer), so a call fails fast
    while Redis is down.

    The app's pool (`broker_redis`) connects through kombu's `Connection.default_channel`, which retries as long as
    `broker_connection_max_retries` allows (forever); a watchdog or a lease renewal must not wait that long. None
    for Sentinel URLs, which go through the pool (it follows failovers).
    """
    settings = get_settings()
    url = settings.broker_url
    if is_sentinel(url):
        return None
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if url.startswith("rediss://"):
        options["ssl_cert_reqs"] = settings.redis_tls_cert_reqs
        if settings.redis_tls_ca_file is not None:
            options["ssl_ca_certs"] = str(settings.redis_tls_ca_file)
    return redis.Redis.from_url(url, **options)


def replicas_wanted() -> int:
    """REDIS_WAIT_REPLICAS: how many replicas must hold a write before it counts (0: the primary alone)."""
    return get_settings().redis_wait_replicas


def add_wait(pipe: Any) -> bool:
    """Queue Redis's `WAIT` on `pipe` (a redis-py pipeline with `transaction=False`: WAIT inside MULTI, or inside
    a script, returns at once) after the writes it holds, when REDIS_WAIT_REPLICAS asks for it; True if queued.
    WAIT covers every earlier write of the pipeline's one connection. Pass the reply to `check_replicas`."""
    wanted = replicas_wanted()
    if wanted <= 0:
        return False
    pipe.execute_command("WAIT", wanted, get_settings().redis_wait_timeout_ms)
    return True


def check_replicas(reached: Any) -> None:
    """Raise `NotReplicated` when WAIT's reply (`reached`) is fewer replicas than REDIS_WAIT_REPLICAS."""
    settings = get_settings()
    if int(reached) < settings.redis_wait_replicas:
        raise NotReplicated(int(reached), settings.redis_wait_replicas, settings.redis_wait_timeout_ms)


def is_oom(exc: BaseException) -> bool:
    """True for Redis's refusal of a write at `maxmemory` (`OOM command not allowed ...`)."""
    # Redis 7 answers `OOM command not allowed ...` (redis-py's OutOfMemoryError); 6.2 wraps a script's refusal in
    # `ERR Error running script ... -OOM command not allowed ...`.
    return isinstance(exc, redis.exceptions.ResponseError) and "OOM command not allowed" in str(exc)


def queue_keys(queue: str) -> list[str]:
    """The Redis list keys kombu uses for `queue`, one per priority step."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS]


def decode_message(raw: bytes | str) -> dict[str, Any]:
    """A kombu Redis message (JSON envelope) as a dict with its body decoded to JSON when possible."""
    envelope: dict[str, Any] = json.loads(raw)
    body = envelope.get("body")
    if envelope.get("properties", {}).get("body_encoding") == "base64" and isinstance(body, str):
        body = base64.b64decode(body)
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            body = body.decode("utf-8", "replace")
    envelope["body"] = body
    return envelope


@dataclass(frozen=True)
class QueueStats:
    name: str
    depth: int
    oldest_age_s: float | None


def _oldest_age(client: redis.Redis, keys: list[str], now: float) -> float | None:
    ages = []
    for key in keys:
        tail = client.lindex(key, -1)  # kombu LPUSHes and BRPOPs: the right end is the oldest
        if tail is None:
            continue
        try:
            published = decode_message(tail).get("headers", {}).get(HEADER_PUBLISHED_AT)
        except ValueError:
            continue
        if isinstance(published, int | float):
            ages.append(max(0.0, now - float(published)))
    return max(ages) if ages else None


def queue_stats(queues: tuple[str, ...] = (*WORK_QUEUES, DEAD_LETTER_QUEUE)) -> list[QueueStats]:
    """Depth (all priorities) and age of the oldest waiting job of each queue."""
    now = time.time()
    with broker_redis() as client:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            for key in queue_keys(queue):
                pipe.llen(key)
        lengths = pipe.execute()
        stats = []
        steps = len(PRIORITY_STEPS)
        for i, queue in enumerate(queues):
            depth = sum(lengths[i * steps : (i + 1) * steps])
            age = _oldest_age(client, queue_keys(queue), now) if depth else None
            stats.append(QueueStats(queue, depth, age))
        return stats


def unacked_count() -> int:
    """Jobs delivered to a worker and not yet acknowledged (running or prefetched), all queues."""
    with broker_redis() as client:
        return int(client.hlen(UNACKED_KEY))


def in_flight_by_queue() -> dict[str, int]:
    """Delivered-but-unacknowledged jobs per queue (kombu keeps `[message, exchange, routing_key]` per tag)."""
    counts: dict[str, int] = {}
    with broker_redis() as client:
        for raw in client.hvals(UNACKED_KEY):
            try:
                queue = str(json.loads(raw)[2])
            except (ValueError, IndexError, TypeError):
                continue
            counts[queue] = counts.get(queue, 0) + 1
    return counts
