"""Read-only views of the Redis broker, a Redis client configured exactly like it, and its URL fit to show.

Queue depth on Redis is the sum of `LLEN` over the queue's key and its priority sub-queue keys
(`<queue>\\x06\\x16<priority>`, `pipeline.queues.priority`), also given per priority level; jobs delivered but not
acknowledged sit in kombu's `unacked` hash. The client comes from the app's broker connection pool, so TLS and
Sentinel settings apply as they do to Celery itself.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import redis
import redis.asyncio

from pipeline import cluster
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.config.celery import is_sentinel
from pipeline.config.cluster import is_cluster
from pipeline.constants import (
    DEAD_LETTER_QUEUE,
    HEADER_PUBLISHED_AT,
    KEY_PREFIX,
    PRIORITY_STEPS,
    UNACKED_KEY,
)
from pipeline.errors import BrokerFull, NotReplicated
from pipeline.lua import script, sha, source
from pipeline.queues import keys as layout
from pipeline.queues import state as queue_state
from pipeline.queues.routed import job_queues, routed_queues

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

    On a Redis Cluster (kombu has no transport for one) it is the process's cluster client (`pipeline.cluster`),
    which has the same commands and sends each to the master of its key's slot.
    """
    if is_cluster(get_settings().broker_url):
        yield cast("redis.Redis", cluster.shared())  # RedisCluster: the same command API, not a subclass
        return
    # celery-types calls `get_app().pool` a ProducerPool; at run time it is the broker's connection pool.
    pool: Any = get_app().pool
    with pool.acquire(block=True, timeout=10) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as client:
            yield client


#: Connections an event loop's own client (`async_redis`) opens at most: a call's round trip is short, so a few dozen
#: serve hundreds of jobs asking at once.
ASYNC_MAX_CONNECTIONS = 32


def _direct_options(timeout: float) -> dict[str, Any]:
    settings = get_settings()
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if settings.broker_url.startswith("rediss://"):  # a cluster's: `pipeline.cluster.options`
        options["ssl_cert_reqs"] = settings.redis_tls_cert_reqs
        if settings.redis_tls_ca_file is not None:
            options["ssl_ca_certs"] = str(settings.redis_tls_ca_file)
    return options


def async_redis(timeout: float, max_connections: int = ASYNC_MAX_CONNECTIONS) -> redis.asyncio.Redis | None:
    """An asyncio client of its own on the broker (for the asyncio pool's event loop), with `timeout` for connect and
    answer; None for Sentinel URLs (their callers use `broker_redis`, which follows failovers).

    At most `max_connections` at once; a call beyond them waits for one to be free (up to `timeout`). redis-py's
    default pool refuses it instead (`MaxConnectionsError` past 100), which a process's jobs ending together reach.
    """
    url = get_settings().broker_url
    if is_sentinel(url):
        return None
    if is_cluster(url):  # at most `max_connections` per node; beyond them redis-py refuses a call
        return cast("redis.asyncio.Redis", cluster.async_client(timeout, max_connections))
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, **_direct_options(timeout)
    )
    return redis.asyncio.Redis.from_pool(pool)  # closing the client closes its pool


def direct_redis(timeout: float) -> redis.Redis | None:
    """A client of its own on the broker with short timeouts (`timeout`: connect and answer), so a call fails fast
    while Redis is down.

    The app's pool (`broker_redis`) connects through kombu's `Connection.default_channel`, which retries as long as
    `broker_connection_max_retries` allows (forever); a watchdog or a lease renewal must not wait that long. None
    for Sentinel URLs, which go through the pool (it follows failovers).
    """
    url = get_settings().broker_url
    if is_cluster(url):
        return cast("redis.Redis", cluster.client(timeout))  # follows the slot map: MOVED, ASK, failovers
    return None if is_sentinel(url) else redis.Redis.from_url(url, **_direct_options(timeout))


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
    # Redis answers `OOM command not allowed when used memory > 'maxmemory'.` (redis-py's OutOfMemoryError, its text
    # without the code); Redis 6.2 wraps a script's refusal in `ERR Error running script ... -OOM command ...`.
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.exceptions.ResponseError) and "used memory > 'maxmemory'" in str(exc)
    )


#: The channel `confirm_replicated` PUBLISHes an empty message on (nobody subscribes). PUBLISH is replicated, so it
#: moves its connection's replication offset to the primary's current one: a WAIT after it covers every write the
#: primary took before it, from any connection (the replication stream is one ordered log).
REPLICATION_BARRIER = f"{KEY_PREFIX}replication-barrier"


def run_script_waited(
    client: redis.Redis, name: str, keys: Sequence[Any], args: Sequence[Any], *, barrier: bool = False
) -> tuple[Any, int | None]:
    """Run script `name` (`pipeline.lua`) and, when REDIS_WAIT_REPLICAS asks, Redis's WAIT after it on the same
    connection, in one round trip (a pipeline without MULTI: [EVALSHA, WAIT]); return the script's reply and the
    replicas WAIT reached (None when nothing was waited for; pass it to `check_replicas`).

    With REDIS_WAIT_REPLICAS=0 this is the plain script call, nothing more. `barrier` adds a replication barrier
    (`REPLICATION_BARRIER`) between the two, for a script that may answer with an earlier write instead of making
    one (an idempotency key already claimed): the WAIT then covers that earlier write too. A script Redis does not
    know yet (NOSCRIPT: a restarted or new server) is loaded and the round trip made again."""
    if replicas_wanted() <= 0:
        return script(name)(keys=keys, args=args, client=client), None
    if layout.clustered():  # redis-py runs no script in a cluster pipeline: the script, then WAIT on its master
        reply = script(name)(keys=keys, args=args, client=client)
        return reply, _barrier_wait(cluster.node_of(client, keys[0]))
    for _ in range(2):
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(sha(name), len(keys), *keys, *args)
        if barrier:
            pipe.publish(REPLICATION_BARRIER, "")
        add_wait(pipe)
        replies = pipe.execute(raise_on_error=False)
        reply = replies[0]
        if not isinstance(reply, redis.exceptions.NoScriptError):
            break
        client.script_load(source(name))
    if isinstance(reply, Exception):
        raise reply
    return reply, _reached(replies[-1])


def _reached(reply: Any) -> int:
    """WAIT's count; an error in its place (`-UNBLOCKED` when the primary is demoted under it) confirmed none: 0."""
    return 0 if isinstance(reply, Exception) else int(reply)


def confirm_replicated(client: redis.Redis, key: str | None = None) -> None:
    """Return once REDIS_WAIT_REPLICAS replicas hold every write the primary took so far (a replication barrier,
    then WAIT, one round trip), else raise `NotReplicated`; nothing at all with REDIS_WAIT_REPLICAS=0. On a cluster,
    the primary is the master serving `key` (a queue's key). For writes made on another connection (a MULTI, which
    cannot hold a WAIT) or earlier (an idempotency key's first job, answered again to a retry)."""
    if replicas_wanted() <= 0:
        return
    if key is not None and layout.clustered():
        client = cluster.node_of(client, key)
    check_replicas(_barrier_wait(client))


def _barrier_wait(client: redis.Redis) -> int:
    """A replication barrier and WAIT on one connection of `client` (one node); the replicas WAIT reached."""
    pipe = client.pipeline(transaction=False)
    pipe.publish(REPLICATION_BARRIER, "")
    add_wait(pipe)
    return _reached(pipe.execute(raise_on_error=False)[-1])


def oom_cause(exc: BaseException) -> BaseException | None:
    """Redis's refusal of a write at `maxmemory` (`is_oom`) that is `exc` or caused it, or None. kombu re-raises
    Redis's errors as its own `OperationalError` (a queue declared on a producer's first publish) from the original."""
    seen: BaseException | None = exc
    while seen is not None:
        if is_oom(seen):
            return seen
        seen = seen.__cause__
    return None


def full(exc: BaseException) -> BrokerFull:
    """`BrokerFull` for Redis's OOM refusal `exc` (`is_oom`), its message without the script's name."""
    text = str(exc).split(". script:")[0]
    return BrokerFull(" ".join(text.split(" caused error: ")[-1].split()))


@contextmanager
def memory_refusals() -> Iterator[None]:
    """Raise `BrokerFull` for Redis's refusal of a write at `maxmemory` inside the block (`oom_cause`); other
    errors pass as they are."""
    try:
        yield
    except Exception as exc:
        refusal = oom_cause(exc)
        if refusal is None or isinstance(exc, BrokerFull):
            raise
        raise full(refusal) from exc


@dataclass(frozen=True)
class MemoryStats:
    """Redis's memory against its limit (`INFO memory`): `max_bytes` 0 means no limit."""

    used_bytes: int
    max_bytes: int
    policy: str
    #: Buffers Redis leaves out when it compares its memory with maxmemory (replication, AOF).
    uncounted_bytes: int = 0

    @property
    def full(self) -> bool:
        """At maxmemory as Redis counts it for a refusal: with noeviction, writes that need memory are refused."""
        return self.max_bytes > 0 and self.used_bytes - self.uncounted_bytes > self.max_bytes

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> MemoryStats:
        """From the reply of `INFO memory`."""
        return cls(
            int(info.get("used_memory", 0)),
            int(info.get("maxmemory", 0)),
            str(info.get("maxmemory_policy", "")),
            int(info.get("mem_not_counted_for_evict", 0)),
        )

    @property
    def used_ratio(self) -> float | None:
        """Used over maxmemory (None without a limit)."""
        return self.used_bytes / self.max_bytes if self.max_bytes else None

    @property
    def policy_warning(self) -> str | None:
        """Why the policy is wrong for a queue (anything but `noeviction` lets Redis delete jobs), or None."""
        if self.policy == "noeviction":
            return None
        return f"maxmemory-policy is {self.policy}: at maxmemory Redis evicts keys, jobs included; use noeviction"


def memory_stats() -> MemoryStats:
    """The broker's memory use, limit and eviction policy (one `INFO memory`: allowed on managed Redis too); on a
    cluster, its fullest master's (the one that refuses writes first)."""
    with broker_redis() as client:
        if not layout.clustered():
            return MemoryStats.from_info(client.info("memory"))
        found = [MemoryStats.from_info(i) for i in cluster.masters_info(cluster.shared(), "memory").values()]
        return max(found, key=lambda m: (m.used_ratio or 0.0, m.used_bytes))


def queue_keys(queue: str) -> list[str]:
    """The Redis list keys of `queue`, one per priority step (most urgent first): kombu's on a single Redis, the
    queue's hash-tagged ones on a cluster (`pipeline.queues.keys`)."""
    return layout.levels(queue)


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
    #: Waiting jobs per priority level (kombu's step: 0, 3, 6, 9; `pipeline.queues.priority`), most urgent first.
    levels: dict[int, int] = field(default_factory=dict)
    #: Paused (`pipeline.scheduling.pause`): it accepts jobs and no worker starts one.
    paused: bool = False


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


def waiting_levels(client: redis.Redis, queues: Iterable[str]) -> dict[str, dict[int, int]]:
    """Jobs waiting per queue and priority level (kombu's steps, most urgent first), in the level's plain list and
    in its groups' lists (`pipeline.fairness.groups`), read in one round trip."""
    queues = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for key in queue_keys(queue):
            pipe.llen(key)
        pipe.hmget(layout.group_count(queue), queue_keys(queue))
    replies = pipe.execute()
    steps = len(PRIORITY_STEPS)
    levels = {}
    for i, queue in enumerate(queues):
        at = i * (steps + 1)
        grouped = [int(n or 0) for n in replies[at + steps]]
        level_lengths = zip(PRIORITY_STEPS, replies[at : at + steps], grouped, strict=True)
        levels[queue] = {step: int(n) + g for step, n, g in level_lengths}
    return levels


def queue_stats(queues: Sequence[str] | None = None) -> list[QueueStats]:
    """Depth (all priorities), age of the oldest waiting job and whether it is paused, of each queue (by default every
    queue the app routes to, `job_queues`, then the dead-letter queue)."""
    if queues is None:
        queues = (*job_queues(get_app()), DEAD_LETTER_QUEUE)
    now = time.time()
    with broker_redis() as client:
        levels = waiting_levels(client, queues)
        paused = queue_state.paused(client, queues)
        stats = []
        for queue in queues:
            depth = sum(levels[queue].values())
            age = _oldest_age(client, queue_keys(queue), now) if depth else None
            stats.append(QueueStats(queue, depth, age, levels[queue], queue in paused))
        return stats


def unacked_count() -> int:
    """Jobs delivered to a worker and not yet acknowledged (running or prefetched), all queues (on a cluster, each
    queue's own record, `pipeline.queues.keys.unacked`, of each queue the app routes to)."""
    with broker_redis() as client:
        if not layout.clustered():
            return int(client.hlen(UNACKED_KEY))
        return sum(queue_state.in_flight(client, routed_queues(get_app())).values())


def in_flight_by_queue() -> dict[str, int]:
    """Delivered-but-unacknowledged jobs per queue the app routes to (`pipeline.queues.state.in_flight`)."""
    with broker_redis() as client:
        return queue_state.in_flight(client, job_queues(get_app()))
