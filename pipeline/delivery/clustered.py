"""The transport on a Redis Cluster (`REDIS_URL=redis+cluster://...`): what Celery's producers and the worker use there.

kombu has no Redis Cluster transport (celery#2852): its Redis transport reads the seed list as one host. This one is
a kombu virtual transport whose channel talks to the cluster through redis-py's `RedisCluster` (`pipeline.cluster`:
it follows MOVED, ASK and a refreshed slot map after a failover), every key of a queue named by
`pipeline.queues.keys` (its hash tag: one slot per queue).

Producers (`apply_async`, `send_task`, canvas): `_put` pushes the message on the queue's list for its priority step
and its wake-up marker (`pipeline:{<q>}:wake`), both in the queue's slot, in one round trip. The queue is the route
of the app's declared queues and ROUTES (Celery sends with the queue's name as routing key), never a
`_kombu.binding.*` set: nothing of kombu's routing table lives in Redis.

The worker (the class `bound` to its `Leases`) fetches per queue: `fetch.lua` runs once per consumed queue with only
that queue's keys (its lists, delivery records, group keys, paused flag, tombstones), the starting queue rotating at
every round so none starves. The deliveries are held, renewed, acknowledged and released per queue (`Leases` knows
each tag's queue). A round that found nothing waits for a wake-up marker: one thread per consumed queue blocks on
its marker (BLMPOP names keys of one slot) while the channel is idle, and wakes the channel; the fallback poll
(`wake_poll_s`) bounds the wait. Every `unacked_restore_interval` seconds, once the worker's renewals allow it
(`Leases.sweep_allowed`), the channel restores the deliveries of its queues whose lease expired (`restore.lua`, per
queue, judged on Redis's clock in the script).

Celery's fanout (control broadcasts, events) goes over pub/sub (kombu's channel names, `/0.<exchange>`): a PUBLISH on
any node reaches the subscribers of every node. Control replies are lists (kombu's pidbox reply queue, popped without
acknowledgement, wherever its name hashes).

The transport is asynchronous: a worker runs Celery's event loop (kombu's hub) on it, so the asyncio pool and
prefork's asynchronous pool run as on a single Redis. The hub does not block on a queue: the same waiter threads wake
it through a self-pipe, and each tick fetches the queues that woke (`pipeline.delivery.cluster_loop`). Celery's
synchronous loop (`drain_events`: a client waiting for replies) rounds over every queue and waits as above.

A queue whose slot is moving between two masters (its keys split, its scripts refused with TRYAGAIN) is skipped for the
round and fetched again at its next one, while the other queues go on; its acknowledgements wait for the renewal
thread, and the sweep leaves it alone for a lease after (`pipeline.delivery.moving`).

Results are stored on the cluster, fenced by an owner stamp the fetch writes beside each result
(`pipeline.delivery.stamps`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

import redis
from kombu.transport import virtual as kombu_virtual
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import ClusterDownError, ClusterError

from pipeline import cluster
from pipeline.constants import PRIORITY_SEPARATOR, PRIORITY_STEPS
from pipeline.delivery import fetch, moving, waking
from pipeline.delivery.cluster_fanout import Fanout
from pipeline.delivery.cluster_loop import Evented, EventedTransport, Waiters
from pipeline.delivery.lease import Leases, records
from pipeline.dlq import elements as undecodable
from pipeline.lua import script
from pipeline.observability import metrics
from pipeline.queues import keys, priority, wake
from pipeline.queues.wake import WAKE_MAX

log = logging.getLogger(__name__)

#: Longest wait for one node's answer on the channel's client (seconds).
CLIENT_TIMEOUT_S = 30.0
#: Deliveries of one queue one sweep looks at, at most.
SWEEP_MAX = 1000

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, ClusterError)


def _shutting_down() -> bool:
    from celery.worker import state as worker_state

    return worker_state.should_stop not in (None, False) or worker_state.should_terminate not in (None, False)


class ClusterQoS(kombu_virtual.QoS):
    """Acknowledgements (fenced: `settle.lua` in the tag's queue's slot) and requeues of the worker's deliveries."""

    channel: ClusterChannel

    def ack(self, delivery_tag: str) -> None:
        leases = self.channel.leases
        if leases is not None:
            try:
                leases.ack(self.channel.client, delivery_tag)
            except (*CONNECTION_ERRORS, redis.ResponseError) as exc:  # an outage, or (`is_moving`) its slot moving
                if not isinstance(exc, CONNECTION_ERRORS) and not moving.is_moving(exc):
                    raise
                leases.remember_ack(delivery_tag, exc)  # applied by the renewal thread once the cluster answers
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue and self.channel.leases is not None:
            with contextlib.suppress(*CONNECTION_ERRORS):  # still leased: renewed, acknowledged or restored later
                self.restore_tag(delivery_tag, leftmost=True, owner=self.channel.leases.owner())
                self.channel.leases.release(delivery_tag)
            kombu_virtual.QoS.ack(self, delivery_tag)
            return
        self.ack(delivery_tag)

    def restore_unacked_once(self, stderr: Any = None) -> Any:
        if _shutting_down():  # a lost connection is not a shutdown: the jobs go on under their leases
            return super().restore_unacked_once(stderr)
        return None

    def restore_unacked(self) -> Any:
        """At shutdown: put back the deliveries this worker still owns."""
        leases = self.channel.leases
        if leases is not None:
            for tag in list(self._delivered or ()):
                with contextlib.suppress(*CONNECTION_ERRORS):
                    self.restore_tag(tag, owner=leases.owner())
                    leases.release(tag)
        if self._delivered is not None:
            self._delivered.clear()
        return []

    def restore_tag(
        self, tag: str, client: Any = None, leftmost: bool = False, owner: str | None = None, ceil: Any = None
    ) -> int:
        """Put `tag` back on its queue and clear its lease (`restore.lua`, in its queue's slot); 1 if restored.
        `owner`: only if that worker holds the lease (else only if the lease expired)."""
        leases = self.channel.leases
        groups = leases.by_records([tag]) if leases is not None else []
        if not groups:
            return 0
        queue = moving.tagged(groups[0][0][0])  # pipeline:{<q>}:unacked (a queue's name holds no brace on a cluster)
        leaving = leases.leaving([tag] if owner is not None else []) if leases is not None else contextlib.nullcontext()
        with leaving:
            return self.channel.restore(queue, tag, owner or "", leftmost)


class ClusterChannel(Fanout, Evented, kombu_virtual.Channel):
    QoS = ClusterQoS
    #: Fetch, lease and restore per queue (`pipeline.delivery.fetch.layout`).
    cluster = True
    sep = PRIORITY_SEPARATOR
    priority_steps = PRIORITY_STEPS
    #: What the last fetch found paused (of its one queue); `paused_queues` keeps every consumed queue's.
    paused: frozenset[str] | set[str] = frozenset()

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        self.leases: Leases | None = getattr(connection, "leases", None)
        self.untracked: set[str] = set()
        self.paused_queues: set[str] = set()
        self.client = moving.impatient(cluster.client(CLIENT_TIMEOUT_S))  # a moving slot's refusal at once
        self.moving = self.leases.moving if self.leases is not None else moving.Moving()
        self._turn = 0
        self.waiters = Waiters(CONNECTION_ERRORS)  # one thread per queue, on its marker (`cluster_loop`)
        self._swept_at = time.monotonic()
        super().__init__(connection, **kwargs)
        options = connection.client.transport_options
        self.restore_interval = float(options.get("unacked_restore_interval", 10))

    @property
    def wake_poll_s(self) -> float:
        """The longest an idle channel waits for a marker before it fetches anyway (seconds): the single-Redis
        channel's (`pipeline.delivery.waking.Waking.wake_poll_s`)."""
        return float(waking.Waking.wake_poll_s)

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        yield client or self.client

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        (self.untracked.add if no_ack else self.untracked.discard)(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _untracked(self, queue: str) -> int:
        """Pop one message of a queue consumed without acknowledgement (Celery's control replies): nothing to
        record or hold, as kombu delivers them."""
        for key in keys.levels(queue, True):
            item = self.client.rpop(key)
            if isinstance(item, bytes):
                payload = undecodable.decode(self, item, queue)
                if payload is not None:
                    self.connection._deliver(payload, queue)
                return 1
        return 0

    # Producers.
    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        step = priority.level(self._get_message_priority(message, reverse=False))
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:  # a recorded publish (`pipeline.compat.batch`): its command, not sent
            batch.add("lpush", keys.level(queue, step, True), json.dumps(message))
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(keys.level(queue, step, True), json.dumps(message))
        if not wake.silent(queue):  # Celery's control replies get none
            pipe.lpush(keys.wake(queue, True), "1")
            pipe.ltrim(keys.wake(queue, True), 0, WAKE_MAX - 1)
        pipe.execute()

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        """The queues a message goes to: the bindings declared in this process, else the queue the routing key
        names (Celery routes a job to a declared queue with the queue's name as routing key)."""
        try:
            found = self.typeof(exchange).lookup(self.get_table(exchange), exchange, routing_key, None)
        except KeyError:
            found = []
        if found or self.typeof(exchange).type == "fanout":
            return list(found)
        if exchange.startswith("reply.") and exchange.endswith(".pidbox"):
            return [f"{routing_key}.{exchange}"]  # kombu's pidbox reply queue (`Mailbox.get_reply_queue`)
        return [str(routing_key or default or self.deadletter_queue)]

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        pass  # a list exists once something is pushed on it

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self.client.exists(*keys.levels(queue, True)))

    def _size(self, queue: str) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys.levels(queue, True):
            pipe.llen(key)
        return int(sum(pipe.execute()))

    def _purge(self, queue: str) -> int:
        size = self._size(queue)
        for key in keys.levels(queue, True):
            self.client.delete(key)
        return size

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._purge(queue)

    # The worker's fetch.
    def _fetch(self, queue: str, count: int) -> int:
        """One `fetch.lua` call on `queue`'s keys; how many elements it took (each handed to kombu)."""
        numkeys, *rest = fetch.args(self, [queue], count)
        try:
            reply = script(fetch.FETCH)(keys=rest[:numkeys], args=rest[numkeys:], client=self.client)
        except moving.ERRORS as exc:  # its slot moving: skipped for the round (`pipeline.delivery.moving`)
            self.moving.skip(queue, exc)
            return 0
        fetch.acknowledged(self, reply, [])
        (self.paused_queues.add if queue in self.paused else self.paused_queues.discard)(queue)
        if len(reply) <= fetch.FIRST:
            return 0
        fetch.deliver(self, reply)
        return (len(reply) - fetch.FIRST) // fetch.FIELDS

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        """The synchronous single get (`basic_get`): one message of `queue`, held under this worker's lease."""
        if self.leases is None:
            raise Empty()
        return fetch.one(self, self.client, queue)

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> Any:
        """kombu's, with the sweep first: a worker whose prefetch is full (kombu asks nothing of its channel then)
        still restores its queues' lapsed leases."""
        self._sweep_when_due(list(self._active_queues))
        return super().drain_events(timeout, callback)

    def _get_many(self, queues: list[str], timeout: float | None = None) -> None:
        """Celery's synchronous loop: one round over `queues`; when it took nothing, wait for a marker on one of them
        (or the fallback poll) and raise Empty."""
        if not queues:
            raise Empty()
        taken, _empty = self._round(queues)
        if taken:
            return
        self._wait(queues, timeout)
        raise Empty()

    def _round(self, queues: list[str]) -> tuple[int, set[str]]:
        """One round over `queues` (starting one further each round), fetching what the prefetch allows, after what
        came over pub/sub: how many it took, and the queues it found empty or moving (a queue the prefetch left
        unasked is not among them)."""
        taken = self._broadcasts()
        empty: set[str] = set()
        if not queues:
            return taken, empty
        self._turn = (self._turn + 1) % len(queues)
        for queue in queues[self._turn :] + queues[: self._turn]:
            if queue in self.untracked:
                took = self._untracked(queue)
            elif self.leases is not None and self.qos.can_consume():
                took = self._fetch(queue, fetch.batch_size(self))
            else:
                continue
            taken += took
            if not took:
                empty.add(queue)
        return taken, empty

    def _wait(self, queues: list[str], timeout: float | None) -> None:
        awake = [queue for queue in queues if queue not in self.untracked and queue not in self.paused_queues]
        if not awake:
            return  # control replies only: the transport's polling interval paces the next round
        self.waiters.arm(awake)
        woken = self.waiters.woken
        deadline = time.monotonic() + float(self.wake_poll_s)
        try:  # in slices: a worker's shutdown is not held up by a long fallback poll
            while not woken.wait(max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or _shutting_down():
                    break
        finally:
            self.waiters.disarm()
            self.waiters.take()

    # Restores.
    def restore(self, queue: str, tag: str, owner: str, leftmost: bool) -> int:
        """Put delivery `tag` of `queue` back on its list (`restore.lua`): while `owner` holds it, or ('') once its
        lease expired; 1 if restored."""
        unacked, index, lease, _count, _log = records(queue)
        raw = self.client.hget(unacked, tag)
        if not isinstance(raw, bytes):
            return 0
        try:
            message, _exchange, _key = json.loads(raw.decode("utf-8", "surrogateescape"))
        except ValueError as exc:  # not what the fetch wrote: dead-lettered rather than fail every sweep
            undecodable.dead_letter(raw, "unacked", exc)
            return 0
        if isinstance(message, str):  # an element that was not a message: back as it was
            dest, element = keys.level(queue, 0, True), message.encode("utf-8", "surrogateescape")
        else:
            with contextlib.suppress(KeyError, TypeError):
                message["headers"]["redelivered"] = True
                message["properties"]["delivery_info"]["redelivered"] = True
            dest = keys.level(queue, priority.level(self._get_message_priority(message, reverse=False)), True)
            element = json.dumps(message).encode()
        argv: list[bytes | str] = [tag, raw, element, owner, "1" if leftmost else "0"]
        marker = keys.wake(queue, True)
        return int(script("restore")(keys=[unacked, index, lease, dest, marker], args=argv, client=self.client))

    def _sweep_when_due(self, queues: list[str]) -> None:
        if self.leases is None or time.monotonic() - self._swept_at < self.restore_interval:
            return
        self._swept_at = time.monotonic()
        if not self.leases.sweep_allowed():
            return  # not renewing for a whole lease yet: a live peer may not have renewed since the cluster came back
        restored = 0
        for queue in queues:
            # A queue whose slot moved a lease ago or less: its workers' acknowledgements refused meanwhile land first.
            if queue in self.untracked or not self.moving.steady_for(queue, self.leases.lease_seconds):
                continue
            with self.moving.skipping(queue):
                index = records(queue)[1]
                lapsed = self.client.zrangebyscore(index, "-inf", time.time() + 1, start=0, num=SWEEP_MAX)
                for tag in lapsed:
                    restored += self.restore(queue, bytes_to_str(tag), "", leftmost=False)
        if restored:
            metrics.leases.labels(outcome="restored").inc(restored)
            log.warning("restored %d job(s) whose lease expired (their worker stopped renewing)", restored)

    def close(self) -> None:
        self.leave_loop()
        self.unsubscribe()
        self.waiters.stop()
        try:
            super().close()
        finally:
            self.client.close()


class ClusterTransport(EventedTransport, kombu_virtual.Transport):
    Channel = ClusterChannel
    driver_type = "redis"
    driver_name = "redis"
    default_port = 6379
    #: Between two empty rounds of a channel that waits on no marker (control replies only).
    polling_interval = 0.05
    #: Fanout over pub/sub (`pipeline.delivery.cluster_fanout`): Celery's control and events are on. Asynchronous:
    #: Celery runs its event loop (kombu's hub) on it (`pipeline.delivery.cluster_loop`).
    implements = kombu_virtual.Transport.implements.extend(
        asynchronous=True, exchange_type=frozenset(["direct", "topic", "fanout"])
    )
    connection_errors = (*kombu_virtual.Transport.connection_errors, *CONNECTION_ERRORS)
    channel_errors = (*kombu_virtual.Transport.channel_errors, redis.ResponseError)
    #: The worker's deliveries (`bound`); None for producers.
    leases: Leases | None = None

    def driver_version(self) -> str:
        return str(redis.__version__)

    def close_connection(self, connection: Any) -> None:
        self.unregister_from_event_loop(connection, None)
        super().close_connection(connection)


def bound(leases: Leases) -> str:
    """The class path of a cluster transport tied to `leases` (as `pipeline.delivery.transport.bound`)."""
    import uuid

    name = f"ClusterTransport_{uuid.uuid4().hex[:12]}"
    globals()[name] = type(name, (ClusterTransport,), {"leases": leases, "__module__": __name__, "__qualname__": name})
    return f"{__name__}:{name}"
