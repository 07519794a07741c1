"""The worker's Redis transport: an atomic fetch-and-track, leases, fenced acknowledgements and restores.

A worker consumes through it: its delivery bootstep (`pipeline.delivery.fencing.DeliveryStep`) sets the app's
`broker_transport` to `bound(leases, ...)`, a subclass tied to that worker's `Leases`, which every channel reaches
as `channel.leases`; producers, beat and Flower keep kombu's own. Queue elements that are not messages are
dead-lettered (`pipeline.dlq.elements`).

kombu 5.7 (`kombu/transport/redis.py`) fetches with BRPOP and records the delivery in a second round trip
(`QoS.append`: HSET `unacked`, ZADD `unacked_index`). A worker killed, or a Redis stopping, between the two loses
the message: it left the list and is recorded nowhere (issue 10; celery/kombu#305, celery/celery#1789). Here
`_brpop_start` sends one Lua script (EVALSHA of `fetch.lua`, through kombu's own poll cycle:
`pipeline.delivery.fetch`) that pops up to as many elements as the channel's prefetch still allows over the consumed
keys in kombu's order and, in the same script, records each exactly as `QoS.append` would (the element's bytes
untouched), plus the lease owner (`pipeline:lease`), a delivery count (`pipeline:deliveries`, which survives kombu's
restore: the tag is in the message) and a bounded delivery history (`pipeline:deliveries:<tag>`). `QoS.append` then
keeps only kombu's in-memory bookkeeping. The count reaches the worker as the message header `x-delivery-count` (1
on the first delivery). The same script first applies the acknowledgements the event loop deferred
(`pipeline.delivery.acks`).

A script cannot block: with every key empty the channel waits for a wake-up marker (`pipeline.queues.wake`) with
one BLMPOP (`pipeline.delivery.waking`), its lists watched for unmarked pushes (`pipeline.delivery.watches`).

kombu's visibility timeout had to outlast the longest job, so a dead worker's jobs waited that long
(celery/celery#5935, celery/celery#2599); leases (`pipeline.delivery.lease`) replace it. Acknowledgements are fenced
(`settle.lua`: removed only while this worker owns the lease) and, on the event loop, written together within the
loop iteration (`pipeline.delivery.acks`); one that cannot reach Redis is remembered and applied by the renewal
thread. kombu's sweep (`restore_visible`) restores deliveries whose lease expired, only once this worker has been
renewing for a whole lease (after an outage every lease looks expired), and clears the lease owner in the same
transaction. A closed connection no longer restores what the channel delivered (running jobs go on and are
acknowledged on reconnect); only a real worker shutdown does (kombu's `restore_at_shutdown`), and only the
deliveries this worker still owns, also with a fetch unanswered in flight (`close`). `_connparams` on a connection
kombu closed raises a connection error (kombu's AttributeError there stopped the worker: issue 10).

Requires Redis >= 7 (BLMPOP). Not supported: kombu's `global_keyprefix`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from queue import Empty
from typing import Any

import redis
from celery.worker import state as worker_state
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
from kombu.utils.encoding import bytes_to_str

from pipeline.broker import is_oom
from pipeline.compat import marking
from pipeline.compat.results import Stored
from pipeline.constants import LEASE_KEY
from pipeline.delivery import acks, fetch, full, replicas, waking, watches
from pipeline.delivery.lapsed import lapsed_by
from pipeline.delivery.lease import Leases
from pipeline.dlq import elements as undecodable
from pipeline.flows.record import Carried
from pipeline.lua import sha
from pipeline.lua import source as lua_source
from pipeline.observability import metrics
from pipeline.queues import wake

log = logging.getLogger(__name__)

#: A delivery in `unacked` with no lease was fetched by a worker of a release without leases (kombu's BRPOP); the
#: sweep leaves it for that release's visibility timeout, so a rolling upgrade does not restore its running jobs.
#: A delivery this release gives up (`release.lua`) has no lease either, but is scored 0: restored at once.
LEGACY_TIMEOUT_S = 11400


def _shutting_down() -> bool:
    return worker_state.should_stop not in (None, False) or worker_state.should_terminate not in (None, False)


class QoS(acks.DeferredAcks, kombu_redis.QoS):
    _sweeps = 0

    def _channel(self) -> Any:
        return self.channel

    @property
    def leases(self) -> Leases:
        return self.channel.leases  # type: ignore[no-any-return]

    def append(self, message: Any, delivery_tag: str) -> None:
        # The fetch script recorded it in Redis already: only kombu's in-memory bookkeeping.
        kombu_virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.ack_now_or_defer(delivery_tag)  # on the event loop: written with this iteration's others
        kombu_virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            try:
                self.restore_tag(delivery_tag, leftmost=True, owner=self.leases.owner())
                self.leases.release(delivery_tag)
            except self._channel().connection_errors:
                self.leases.drop([delivery_tag])  # else renewed for good: given up on reconnect, for a sweep
        else:
            self._fenced_ack(delivery_tag)
        kombu_virtual.QoS.ack(self, delivery_tag)

    def _fenced_ack(self, delivery_tag: str) -> None:
        if self._deferred_results:
            self.flush_acks(carry=False)  # results held for a later call go first: none lands after its ack
        try:
            if self._channel().closed or self._channel().connection is None:
                raise redis.exceptions.ConnectionError("the channel is closed")
            with self._channel().conn_or_acquire() as client:
                self.leases.ack(client, delivery_tag)
        except self._channel().connection_errors as exc:
            self.leases.remember_ack(delivery_tag, exc)

    def restore_unacked_once(self, stderr: Any = None) -> Any:
        self.flush_acks(carry=False)
        self._channel()._settle_carried(redis.exceptions.ConnectionError("the channel closed"))
        if _shutting_down():
            return super().restore_unacked_once(stderr)
        # A lost connection, not a shutdown: the jobs go on; their leases are renewed, their acks applied later.
        self._on_collect.cancel()  # type: ignore[attr-defined]  # kombu virtual.QoS
        self._flush()  # type: ignore[attr-defined]
        return None

    def restore_unacked(self, client: Any = None) -> Any:
        """At shutdown: put back the deliveries this worker still owns (kombu's restore_at_shutdown)."""
        me = self.leases.owner()
        with self._channel().conn_or_acquire(client) as conn:
            for tag in list(self._delivered or ()):
                self.restore_tag(tag, conn, owner=me)
                self.leases.release(tag)
        if self._delivered is not None:
            self._delivered.clear()

    def restore_visible(self, start: int = 0, num: int | None = None, interval: int = 1) -> Any:
        if not self.leases.sweep_allowed():
            return None  # not renewing for a whole lease yet: a live peer may not have renewed since Redis came back
        self._sweeps += 1
        if (self._sweeps - 1) % (interval or 1):
            return None
        restored = 0
        with self._channel().conn_or_acquire() as client:
            ceil = lapsed_by(client, self.unacked_index_key)  # scores are expiries on Redis's clock (fetch.lua)
            if ceil is None:
                return None  # no lease lapsed: no mutex, no range read (`pipeline.delivery.lapsed`)
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key, ceil, 0, desc=True, byscore=True, offset=num and start, num=num
                    )
                    for tag in visible or []:
                        restored += self.restore_tag(bytes_to_str(tag), client, ceil=ceil)
            except kombu_redis.MutexHeld:
                return None
            except redis.exceptions.ResponseError as exc:  # the mutex and the restores are MULTIs: refused when full
                if not is_oom(exc):
                    raise
                full.STATE.refused("the sweep of expired leases (a MULTI)", exc)
                return None
        if restored:
            metrics.leases.labels(outcome="restored").inc(restored)
            log.warning("restored %d job(s) whose lease expired (their worker stopped renewing)", restored)
        return None

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        self.restore_tag(tag, client, leftmost, owner=self.leases.owner())  # kombu's callers: only what I own
        self.leases.release(tag)  # back on its queue (or a peer's): no longer held here

    def restore_tag(
        self,
        tag: str,
        client: Any = None,
        leftmost: bool = False,
        owner: str | None = None,
        ceil: float | None = None,
    ) -> int:
        """Put `tag` back on its queue and clear its lease, in one WATCHed transaction; 1 if restored.

        `owner`: only if that worker holds the lease. `ceil`: only if its lease expired before that."""
        done = 0

        def restore_transaction(pipe: Any) -> None:
            nonlocal done
            done = 0
            raw = pipe.hget(self.unacked_key, tag)
            holder = pipe.hget(LEASE_KEY, tag)
            score = pipe.zscore(self.unacked_index_key, tag)
            pipe.multi()
            if owner is not None and bytes_to_str(holder or b"") != owner:
                return
            if ceil is not None and score is not None and score > ceil:
                return  # renewed since the sweep read the index
            if ceil is not None and holder is None and score is not None and score > ceil - LEGACY_TIMEOUT_S:
                return  # fetched by a worker without leases (a rolling upgrade): its old visibility timeout applies
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag).hdel(LEASE_KEY, tag)
            if raw:
                _restore_record(self.channel, raw, pipe, leftmost)
                done = 1

        # The holder's own requeue clears its lease: not lost to a renewal meanwhile (a sweep's restore holds none).
        leaving = self.leases.leaving([tag] if owner is not None else [])
        with leaving, self._channel().conn_or_acquire(client) as conn:
            conn.transaction(restore_transaction, self.unacked_key, LEASE_KEY, self.unacked_index_key)
        return done


def _restore_record(channel: Any, raw: bytes, pipe: Any, leftmost: bool) -> None:
    try:
        message, exchange, routing_key = json.loads(raw.decode("utf-8", "surrogateescape"))
    except ValueError as exc:  # not what the fetch wrote: dead-letter it rather than fail every sweep
        undecodable.dead_letter(raw, "unacked", exc)
        return
    if isinstance(message, str):  # an element that was not a message: back where it was, byte for byte
        key = routing_key
        (pipe.lpush if leftmost else pipe.rpush)(key, message.encode("utf-8", "surrogateescape"))
        wake.mark(pipe, key)
        return
    channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)


class _Leased(waking.Waking, marking.Marked, full.FullRedis):
    """The fetch and the guarded connection parameters, shared by the plain and the Sentinel channel."""

    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        # The worker's deliveries, from the transport class it was bound to (`bound`): kept, since kombu clears
        # `connection` when it closes the channel.
        if connection.leases is None:
            raise RuntimeError("the worker transport is used unbound: consume through `transport.bound(leases)`")
        self.leases: Leases = connection.leases
        #: Queues consumed without acknowledgement (Celery's control replies): the fetch leaves their messages
        #: unrecorded, as kombu's `basic_consume` leaves them out of its QoS.
        self.untracked: set[str] = set()
        self.watches = watches.Watches(self)  # on the consumed lists while the channel waits
        super().__init__(connection, *args, **kwargs)  # type: ignore[call-arg]  # kombu's Channel, after this mixin

    def basic_consume(self: Any, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        (self.untracked.add if no_ack else self.untracked.discard)(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)  # type: ignore[misc]  # kombu Channel, after this mixin

    connection: Any
    _waiting = False  # the command in flight is a wait, not a fetch
    _empty = False  # the last fetch found nothing: wait before the next one
    # acknowledgements, results and flow nodes the fetch in flight carries
    _carried: tuple[list[str], list[Stored], list[tuple[Carried, str]]] | None = None
    paused: frozenset[str] | set[str] = frozenset()  # consumed queues the last fetch found paused
    _replicas_due = False  # a WAIT was sent after the fetch in flight: its reply is read after the fetch's

    def _fetch_soon(self: Any) -> bool:
        """True when a fetch is in flight, or kombu's next poll start sends one (not a wait) on this open channel."""
        if self.closed or self._closing or not self.active_queues:
            return False
        if self._in_poll:
            return not self._waiting
        return not self._empty and bool(self.qos.can_consume())

    def _settle_carried(self: Any, exc: BaseException) -> None:
        """The fetch carrying acknowledgements (and results, nodes) got no reply: they may not have been applied."""
        carried, self._carried = self._carried, None
        if carried:
            self.leases.remember(carried[0], exc, carried[1])
            self.qos.nodes_lost(carried[2])

    def close(self: Any) -> None:
        """kombu's, also when Redis went away without answering the fetch in flight: kombu's own stopped at that
        reply's connection error, its QoS kept the acknowledgements deferred for the next fetch unwritten, and the
        consumer's `on_close` gave the leases of those finished jobs up (a sweep ran them again)."""
        self.end_wait()  # a wait for a marker is not read to its end (`pipeline.delivery.waking`)
        if self._in_poll:
            with contextlib.suppress(Empty, *self.connection_errors):
                self._brpop_read()  # what that fetch carried is remembered (`_settle_carried`)
        try:
            super().close()  # type: ignore[misc]  # kombu's Channel, after this mixin
        finally:
            self.watches.close()  # the watches' connections on the consumed lists

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:  # closed: kombu cleared it
            raise redis.exceptions.ConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]

    def _brpop_start(self: Any, timeout: float | None = None) -> None:
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        if self._empty:
            command = self._wait_command(queues, timeout)
            self._waiting = True
        else:
            if self._carried:  # the last fetch's reply never came: what it carried may not be applied
                self._settle_carried(redis.exceptions.ConnectionError("no reply to the last fetch"))
            self._carried = tags, results, nodes = self.qos.take_acks()
            self.leases.settling(tags)  # the script below removes their leases: not lost to a renewal meanwhile
            count = fetch.batch_size(self)
            command = ["EVALSHA", sha(fetch.FETCH), *fetch.args(self, queues, count, tags, results, nodes)]
            self._waiting = False
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        durable = None if self._waiting else replicas.wait_command()
        self._replicas_due = durable is not None
        if durable is None:
            self.client.connection.send_command(*command)
        else:  # the fetch's records and the acknowledgements it carries reach the replicas before a job starts
            conn = self.client.connection
            conn.send_packed_command(conn.pack_commands([command, durable]))

    def _brpop_read(self: Any, **options: Any) -> bool:
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "EVALSHA", **options)
            except redis.exceptions.NoScriptError as exc:
                self._settle_carried(exc)  # the script did not run: the renewal thread applies them
                if self._replicas_due:  # WAIT's reply first: SCRIPT LOAD's comes after it on this connection
                    self._replicas_due = False
                    self._read_replicas(options)
                self.client.script_load(lua_source(fetch.FETCH))  # Redis restarted (empty script cache): loaded now
                raise Empty() from None
            except self.connection_errors as exc:
                self._settle_carried(exc)
                self._replicas_due = False  # nothing more to read on a connection that is gone
                self.client.connection.disconnect()
                raise
            except redis.exceptions.ResponseError as exc:
                if not is_oom(exc):
                    raise
                full.refused(self, exc)
                raise Empty() from None
            finally:
                if self._replicas_due:  # WAIT's reply follows the fetch's, on the same connection
                    self._replicas_due = False
                    self._read_replicas(options)
            if self._waiting:
                self._empty = False  # woken (or timed out): fetch next
                self.waited(reply)
                raise Empty()
            carried, self._carried = self._carried, None
            fetch.acknowledged(self, reply, carried[0] if carried else [])
            if carried and carried[2]:  # before the next jobs run: a join a node lets run is queued first
                self.qos.nodes_answered(carried[2], reply[2])
            if len(reply) <= fetch.FIRST:
                self._empty = True
                raise Empty()
            self._empty = False
            self._wait_s = waking.WAIT_MIN_S
            self._idle_waits = 0  # a job: the fallback poll starts over
            fetch.deliver(self, reply)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _read_replicas(self: Any, options: dict[str, Any]) -> None:
        """WAIT's reply after a fetch: fewer replicas than REDIS_WAIT_REPLICAS is logged and counted (the jobs go on:
        a failover now could deliver them again)."""
        try:
            reached = self.client.parse_response(self.client.connection, "WAIT", **options)
        except redis.exceptions.ResponseError:
            return
        replicas.check(reached, "a fetch")

    # The synchronous path (`basic_get`, `drain_events` without a hub): the same script, one queue.
    def _get(self: Any, queue: str, timeout: float | None = None) -> Any:
        with self.conn_or_acquire() as client:
            try:
                return fetch.one(self, client, queue)
            finally:
                self._maybe_update_queues_expire(client, queue)


class Channel(_Leased, kombu_redis.Channel):
    QoS = QoS


class Transport(watches.Polled, kombu_redis.Transport):
    Channel = Channel
    #: The worker's deliveries (`bound`); None on the unbound class, which no connection uses.
    leases: Leases | None = None


class SentinelChannel(_Leased, kombu_redis.SentinelChannel):
    QoS = QoS


class SentinelTransport(watches.Polled, kombu_redis.SentinelTransport):
    Channel = SentinelChannel
    leases: Leases | None = None


def bound(leases: Leases, sentinel: bool = False) -> str:
    """The class path of a transport tied to `leases` (each of its channels reaches them): a subclass registered in
    this module under a name of its own. A path, not the class, is what `broker_transport` holds: Celery's `stats`
    and `conf` replies carry it as JSON, and the worker logs it as the broker URL's scheme."""
    base: type[Any] = SentinelTransport if sentinel else Transport
    name = f"{base.__name__}_{uuid.uuid4().hex[:12]}"
    globals()[name] = type(name, (base,), {"leases": leases, "__module__": __name__, "__qualname__": name})
    return f"{__name__}:{name}"
