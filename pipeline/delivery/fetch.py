"""The worker's fetch: up to k messages popped and recorded as held by one Lua script, then delivered in order.

`pipeline.delivery.transport` sends `fetch.lua` through kombu's poll cycle (`_brpop_start`) and hands the reply to
`deliver`. k is how many more deliveries the channel's QoS allows (kombu's `can_consume_max_estimate`:
prefetch count minus what the channel holds unacknowledged), so a batch never takes the worker past its
prefetch, and at most FETCH_MAX (FETCH_MAX_IN_FLIGHT on the asyncio pool: `in_flight_pool`).

The script pops from the consumed keys in kombu's order (priority steps, then queues), the oldest element of a
key first (`RPOP key count`), and records each one as kombu's `QoS.append` would (`unacked`, `unacked_index`),
plus the lease owner, the delivery count and the delivery history: nothing can happen between the pop and the
record. Every delivered tag is held (`Leases.hold`, so the renewal thread renews it) before the first is handed
to kombu: a solo worker runs each job inside `_deliver`, and the batch's later jobs wait meanwhile. Celery
acknowledges a job in the event loop's next iteration (`Consumer.call_soon_ack`: `hub.call_soon`), so a solo
worker's acknowledgements of a batch, and the results its jobs handed over (`pipeline.delivery.acks`), are written
after the batch, by the next fetch or the tick's flush: a solo worker killed mid-batch re-runs the batch's finished
jobs after their lease (at most the prefetch less one; their results were not stored either). If a delivery raises
(a solo worker's SIGTERM runs through the job), the deliveries not handed over yet go back to the head of
their queue, or, when Redis cannot be reached, are given up for a sweep to restore (`Leases.drop`).

The script pops nothing from a paused queue (`pipeline.scheduling.pause`) and names the consumed queues it found
paused (an idle channel does not wait on their markers: `pipeline.delivery.waking`). A batch's later job that would
start more than PAUSE_RECHECK_S after the batch was fetched is started only if its queue is still not paused, else
it goes back to the head of its queue like the deliveries above, its delivery not counted (`_uncount`): a pause
reaches the jobs a worker already holds within PAUSE_RECHECK_S.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from queue import Empty
from typing import Any

from kombu.utils.encoding import bytes_to_str

from pipeline.compat.results import Stored
from pipeline.config import get_settings
from pipeline.constants import (
    DELIVERIES_KEY,
    GROUP_KEY_PREFIX,
    HEADER_DELIVERY_COUNT,
    HEADER_LEASE_OWNER,
    HEADER_LEASE_QUEUE,
    HEADER_RATE_GRANT,
    LEASE_KEY,
    PAUSED_KEY,
)
from pipeline.delivery import acks, cancelled, stamps
from pipeline.delivery.lease import HISTORY_PREFIX, records
from pipeline.dlq import elements as undecodable
from pipeline.flows.record import Carried
from pipeline.lua import script
from pipeline.queues import keys
from pipeline.queues.keys import Records
from pipeline.scheduling import ratelimit

log = logging.getLogger(__name__)

#: Deliveries kept in a message's history, and how long the history outlives its last delivery (seconds).
DELIVERY_LOG_MAX = 20
DELIVERY_LOG_TTL_S = 7 * 86400
#: Messages one fetch takes at most.
FETCH_MAX = 32
#: The same, in a process whose pool keeps many jobs in flight at once (the asyncio pool: `in_flight_pool`). A batch
#: starts together and, against an endpoint of steady latency, ends together: large batches become waves that leave
#: slots empty while the next one is fetched (one fetch is in flight at a time); small ones, fetched as slots free,
#: keep them full (one process, 100 in flight, a 100 ms endpoint: 0.70 of the endpoint's limit at 32, 0.80 at 16,
#: 0.82 at 12 and 8, the last at more CPU per job; docs/benchmarks.md).
FETCH_MAX_IN_FLIGHT = 12
_most = FETCH_MAX
#: Fields per fetched element in the script's reply, and where the first element starts (after the fenced tags, the
#: paused queues and the carried nodes' answers).
FIELDS = 8
FIRST = 3
#: A job of a batch that starts longer than this after the batch was fetched (or its queue last found running) is
#: started only if its queue is still not paused (seconds; `pipeline.scheduling.pause`).
PAUSE_RECHECK_S = 0.1

#: The fetch script (`fetch.lua`: its KEYS and ARGV layout are written at its top).
FETCH = "fetch"
#: What a fetched element is (the script's fifth field): a message envelope held under this worker's lease; an
#: element that is not one (held, dead-lettered here); a message of a queue consumed without acknowledgement
#: (Celery's control replies), not recorded in Redis and not held.
ENVELOPE, NOT_AN_ENVELOPE, UNTRACKED = 0, 1, 2
#: A cancelled job's message (its tombstone is set: `pipeline.control.cancel`): acknowledged by the script, dropped
#: unrun.
CANCELLED = 3


def in_flight_pool() -> None:
    """This process's pool keeps many jobs in flight at once: each fetch takes at most FETCH_MAX_IN_FLIGHT."""
    global _most  # one pool per worker process
    _most = FETCH_MAX_IN_FLIGHT


def batch_size(channel: Any) -> int:
    """How many messages the channel may take now: what its QoS allows, at least 1 (kombu only polls a channel
    that can consume), at most FETCH_MAX (or FETCH_MAX_IN_FLIGHT)."""
    room = channel.qos.can_consume_max_estimate()
    return _most if room is None else max(1, min(int(room), _most))


def layout(channel: Any, queues: list[str]) -> tuple[Records, list[str], str, str]:
    """The keys one fetch of `queues` names: the delivery records, the consumed lists (kombu's order), the groups'
    prefix and where pauses are kept. On a Redis Cluster (a channel with `cluster` set) one call fetches from one
    queue, every key in its slot (`pipeline.queues.keys`)."""
    if getattr(channel, "cluster", False):
        (queue,) = queues
        return records(queue), keys.levels(queue, True), keys.group_prefix(queue, True), keys.paused(queue, True)
    lists = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps for queue in queues]
    single = (channel.unacked_key, channel.unacked_index_key, LEASE_KEY, DELIVERIES_KEY, HISTORY_PREFIX)
    return single, lists, GROUP_KEY_PREFIX, PAUSED_KEY


def args(
    channel: Any,
    queues: list[str],
    count: int,
    acks: list[str] | None = None,
    results: list[Stored] | None = None,
    nodes: list[tuple[Carried, str]] | None = None,
) -> list[Any]:
    """numkeys, KEYS and ARGV of `fetch.lua` for `queues` (kombu's key order), taking at most `count` messages after
    storing `results`, acknowledging `acks` and recording `nodes` (fan-out items of flows, with their jobs' tags)."""
    records_, lists, prefix, paused_key = layout(channel, queues)
    untracked = channel.untracked
    flags = [queue in untracked for _pri in channel.priority_steps for queue in queues]
    names: list[Any] = list(lists)
    results = results or []
    nodes = nodes or []
    names += [key for key, _value, _expires, _tag in results]
    names += [node.key() for node, _tag in nodes]
    names.append(paused_key)
    return [
        4 + len(names),
        *records_[:4],
        *names,
        repr(channel.leases.lease_seconds),
        channel.leases.owner(),
        channel.leases.node(),
        f"{uuid.uuid4().hex}:",
        records_[4],
        DELIVERY_LOG_MAX,
        DELIVERY_LOG_TTL_S,
        "".join("1" if flag else "0" for flag in flags),
        count,
        len(results),
        get_settings().group_concurrency,
        prefix,
        len(nodes),
        "" if getattr(channel, "cluster", False) else rate_limits(),  # a limiter is a slot of its own there
        *(x for _key, value, expires, tag in results for x in (value, expires, tag)),
        *(x for node, _tag in nodes for x in node.args()),
        *(acks or ()),
    ]


#: A rate slot the fetch took for an element: the limiter's key, the wait before the slot (s), the slot (epoch s on
#: Redis's clock).
Grant = tuple[str, float, float]


def rate_limits() -> str:
    """`fetch.lua`'s ARGV[14]: the cluster-wide limits of this process's tasks, as JSON (see the script)."""
    limits = {}
    for name, limit in ratelimit.limited_tasks():
        try:
            interval_ms, tolerance_ms = limit.interval_and_tolerance_ms()
        except ValueError:
            continue  # a malformed rate: the job asks when it runs, and fails there with it
        keyed = 1 if limit.key is not None else 0
        limits[name] = [interval_ms, tolerance_ms, keyed, limit.redis_key(name, None)]
    return json.dumps(limits) if limits else ""


def elements(reply: list[Any]) -> list[tuple[str, str, int, bytes, int, Grant | None]]:
    """The script's fetched elements as (key, tag, delivery count, element, kind: ENVELOPE, NOT_AN_ENVELOPE,
    UNTRACKED or CANCELLED, the rate slot it took or None), oldest first."""
    return [
        (
            bytes_to_str(reply[i]),
            bytes_to_str(reply[i + 1]),
            int(reply[i + 2]),
            reply[i + 3],
            int(reply[i + 4]),
            _grant(reply[i + 5 : i + 8]),
        )
        for i in range(FIRST, len(reply), FIELDS)
    ]


def paused(reply: list[Any]) -> set[str]:
    """The consumed queues the fetch found paused (`pipeline.scheduling.pause`)."""
    return {bytes_to_str(queue) for queue in reply[1]} if len(reply) >= 2 else set()


def acknowledged(channel: Any, reply: list[Any], acks: list[str]) -> None:
    """Forget the acknowledgements the fetch carried; log those it fenced (as `Leases.settle` does). Note the
    consumed queues it found paused (`pipeline.delivery.waking`)."""
    channel.leases.settled(acks, reply[0] if reply else [])
    channel.paused = paused(reply)


def _grant(fields: list[Any]) -> Grant | None:
    key, wait_ms, slot_ms = fields
    return (bytes_to_str(key), float(wait_ms) / 1000, float(slot_ms) / 1000) if key else None


def accept(
    channel: Any, key: str, tag: str, count: int, item: bytes, kind: int, queue: str, grant: Grant | None = None
) -> Any:
    """The envelope to deliver for one fetched element, held under this worker's lease; None when there is none
    (dead-lettered, or a copy this worker still holds goes on instead)."""
    leases = channel.leases
    if kind == UNTRACKED:  # nothing recorded, nothing to hold or acknowledge: as kombu delivers it
        return undecodable.decode(channel, item, queue)
    if kind == CANCELLED:  # acknowledged by the script already: counted, never run
        cancelled.dropped(item, queue)
        return None
    payload = None
    if kind == NOT_AN_ENVELOPE:
        undecodable.dead_letter(item, queue, undecodable.UndecodableMessage("not a message envelope"))
    else:
        payload = undecodable.decode(channel, item, queue)
    if payload is None:  # dead-lettered: take it out of `unacked` (it was tracked by the fetch)
        with channel.conn_or_acquire() as client:
            leases.ack(client, tag)
        return None
    if leases.rehold(tag):
        # Its earlier delivery is still here (running or waiting): that copy goes on, under this fetch's lease.
        log.warning("delivery %s fetched again while this worker still holds it: the held copy goes on", tag)
        headers = payload.get("headers")
        if isinstance(headers, dict):  # its result's stamp names this worker again (best effort: the rare case)
            with contextlib.suppress(*_errors(channel)):
                stamps.one(channel, tag, {**headers, HEADER_DELIVERY_COUNT: count}, leases.owner())
        return None
    headers = payload.get("headers")
    if isinstance(headers, dict):
        headers[HEADER_DELIVERY_COUNT] = count
        headers[HEADER_LEASE_OWNER] = leases.owner()  # what a result store checks the lease against
        if leases.cluster:
            headers[HEADER_LEASE_QUEUE] = queue  # where that lease is kept on a cluster (its queue's slot)
        headers.pop(HEADER_RATE_GRANT, None)  # only this fetch's own: never one a message carries
        if grant is not None:
            rate_key, wait, slot = grant
            headers[HEADER_RATE_GRANT] = {"key": rate_key, "slot": slot, "due": time.time() + wait}
    leases.hold(tag, queue)
    if isinstance(channel.qos, acks.DeferredAcks):
        channel.qos.fetched(tag)
    return payload


def one(channel: Any, client: Any, queue: str) -> Any:
    """The synchronous path (`basic_get`, `drain_events` without a hub): one message of `queue`, fetched and held by
    the same script; Empty when there is none to deliver."""
    numkeys, *rest = args(channel, [queue], 1)
    reply = script(FETCH)(keys=rest[:numkeys], args=rest[numkeys:], client=client)
    if len(reply) <= FIRST:
        raise Empty()
    ((key, tag, count, item, kind, grant),) = elements(reply)
    payload = accept(channel, key, tag, count, item, kind, queue, grant)
    if payload is None:
        raise Empty()
    try:
        if not stamps.stamped(channel, [(tag, queue, payload)]):
            raise Empty()
    except _errors(channel):
        _put_back(channel, [tag])
        raise
    return payload


def deliver(channel: Any, reply: list[Any]) -> None:
    """Hold every fetched message, then hand each to kombu in order (see the module doc)."""
    ready: list[tuple[str, str, Any]] = []
    for key, tag, count, item, kind, grant in elements(reply):
        if getattr(channel, "cluster", False):
            dest = keys.queue_of(key, True)  # the channel rotates its queues itself (`pipeline.delivery.clustered`)
        else:
            dest = key.rsplit(channel.sep, 1)[0]
            channel._queue_cycle.rotate(dest)
        payload = accept(channel, key, tag, count, item, kind, dest, grant)
        if payload is not None:
            ready.append((tag, dest, payload))
    done, held_back = 0, []
    checked = time.monotonic()
    try:
        ready = stamps.stamped(channel, ready)  # on a cluster, results' owner stamps before any job runs
        for tag, dest, payload in ready:
            if tag and time.monotonic() - checked > PAUSE_RECHECK_S:  # a batch's later job: its queue paused since?
                if _paused_now(channel, dest):
                    held_back.append(tag)
                    done += 1
                    continue
                checked = time.monotonic()
            with acks.delivering(channel.qos):  # a solo worker's job runs in here and hands its result over
                channel.connection._deliver(payload, dest)
            done += 1
    finally:
        rest = held_back + [tag for tag, _dest, _payload in ready[done:] if tag]
        if held_back:
            _uncount(channel, held_back)
        if rest:
            _put_back(channel, rest)


def _errors(channel: Any) -> tuple[type[BaseException], ...]:
    """The connection errors of `channel`'s transport (kombu's Redis channel has them too; the cluster's has not)."""
    return tuple(channel.connection.connection_errors)


def _paused_now(channel: Any, queue: str) -> bool:
    """Whether `queue` is paused now (`pipeline.scheduling.pause`): a job fetched before the pause does not start."""
    try:
        with channel.conn_or_acquire() as client:
            if getattr(channel, "cluster", False):
                return bool(client.exists(keys.paused(queue, True)))
            return bool(client.sismember(PAUSED_KEY, queue))
    except _errors(channel):
        return False  # not known: it goes on, as it would have without the check


def _uncount(channel: Any, tags: list[str]) -> None:
    """Deliveries held back unstarted for a pause: not counted toward MAX_DELIVERIES (a queue paused and resumed
    again and again would otherwise dead-letter a job that never ran)."""
    try:
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for records_, group in channel.leases.by_records(tags):
                for tag in group:
                    pipe.hincrby(records_[3], tag, -1)
            pipe.execute()
    except _errors(channel):
        pass  # still counted: the limit comes one delivery sooner for them


def _put_back(channel: Any, tags: list[str]) -> None:
    """Deliveries fetched but never handed to kombu: back at the head of their queue (oldest nearest the head)."""
    leases = channel.leases
    me = leases.owner()
    try:
        for tag in reversed(tags):
            channel.qos.restore_tag(tag, owner=me)
            leases.release(tag)
    except _errors(channel):
        leases.drop(tags)  # still leased to this worker: given up, so a sweep restores them
