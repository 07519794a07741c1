"""A worker on a full Redis: `maxmemory` reached with policy `noeviction` (what a queue must run with).

At maxmemory Redis refuses every command that may grow memory (`denyoom`), every command queued in a MULTI (reads
included), and a script whose first write may grow memory; a script whose first write frees memory runs to its
end. The delivery scripts are written that way (`pipeline.lua`: fetch, settle, store, renew, release), so the
workers drain the backlog that filled Redis. What else a worker sends is handled here, never as a lost connection
(Celery's consumer takes any Redis error for one, `broker_channel_error_retry`, and would reconnect in a loop):

- the wait on an empty queue (`BLMOVE`, denyoom) is refused: for WAIT_S after a refusal the channel waits with
  `BRPOP` on WAIT_KEY, a key nothing writes (a pause Redis runs at maxmemory) (`refused`, `waiting`);
- kombu's queue size (`Channel._size`, asked as Celery declares each queue) is read without MULTI;
- kombu's binding write (`Channel._queue_bind`: SADD in a MULTI, or kombu's binding script for a queue that
  expires) is refused even when the binding is there: a binding in place is kept as it is; one that is not
  there (the worker's remote-control mailbox, its gossip queue, a queue never declared before) is skipped and
  bound again once Redis has room (`Channel.maybe_refresh_binding_expiry`, every second); a reply queue's
  (mingle's broadcast) is skipped: the next broadcast declares its own;
- kombu's refresh of expiring bindings (scripts that grow memory) waits for room; its delete of a reply or
  auto-delete queue (a MULTI) is skipped.

Each write skipped is said once, with a WARNING naming maxmemory; the process says once that Redis is full
(`FullState.refused`) and once that it has room again (`FullState.room`: INFO memory read every ROOM_CHECK_S while
full, room meaning ROOM_MARGIN below maxmemory). `pipeline exporter` serves the gauge `pipeline_redis_full`
(`pipeline.broker.MemoryStats.full`).

Not handled: kombu's sweep of expired leases and a holder's requeue are MULTIs, refused until Redis has room again
(`pipeline.delivery.transport.QoS.restore_visible` says so once and tries again at its next sweep).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from pipeline.broker import MemoryStats, is_oom

log = logging.getLogger("pipeline.delivery.transport")

#: How long a channel waits with BRPOP on WAIT_KEY after Redis refused a command for memory (seconds).
WAIT_S = 5.0
WAIT_KEY = "pipeline:full-wait"
#: How often a process that saw Redis full reads INFO memory to learn that it has room again (seconds).
ROOM_CHECK_S = 1.0
#: How far below maxmemory Redis must be to count as having room again (a fraction of maxmemory).
ROOM_MARGIN = 0.01
#: Where Celery's broadcasts (mingle's among them) have their replies sent.
REPLY_EXCHANGE = "reply.celery.pidbox"


class FullState:
    """Whether Redis refused this process a write for memory: each change said once, and each write skipped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.full = False
        self.skipped: set[str] = set()
        self.checked_at = 0.0

    def refused(self, what: str, exc: BaseException) -> None:
        """Redis refused `what` for memory (`exc`): say so, once per state change and once per `what`."""
        with self._lock:
            first, self.full = not self.full, True
            new = what not in self.skipped
            self.skipped.add(what)
        if first:
            log.warning(
                "Redis is at maxmemory (%s): writes that need memory are refused; this worker drains the backlog "
                "(its fetch and acknowledgements free memory, results are stored all the same)",
                exc,
            )
        if new:
            log.warning("Redis is at maxmemory: %s skipped until it has room", what)

    def room(self) -> None:
        """Redis took a write that needs memory, or INFO memory shows room: say so once."""
        with self._lock:
            was, self.full = self.full, False
            self.skipped.clear()
        if was:
            log.warning("Redis has room again (below maxmemory): writes that need memory are accepted")

    def check_due(self) -> bool:
        """True at most every ROOM_CHECK_S while full: time to look for room (`has_room`)."""
        now = time.monotonic()
        if not self.full or now - self.checked_at < ROOM_CHECK_S:
            return False
        self.checked_at = now
        return True


#: This process's view (a worker's main process: every channel of its consumer shares it).
STATE = FullState()


def has_room(client: Any) -> bool:
    """Whether Redis is ROOM_MARGIN below maxmemory, as it counts memory for refusals (`MemoryStats.full`): not a
    few bytes under it, which the next connection's buffers take back."""
    memory = MemoryStats.from_info(client.info("memory"))
    return memory.max_bytes == 0 or memory.used_bytes - memory.uncounted_bytes <= memory.max_bytes * (1 - ROOM_MARGIN)


def refused(channel: Any, exc: BaseException) -> None:
    """Redis refused a channel's command for memory: what a fetch carried was not applied (a script refused at its
    first write writes nothing); the channel waits with BRPOP for WAIT_S, and fetches next."""
    channel._settle_carried(exc)
    STATE.refused("the wait for new jobs with BLMOVE (waiting with BRPOP instead)", exc)
    channel.full_until = time.monotonic() + WAIT_S
    channel._empty = False


def waiting(channel: Any) -> bool:
    """True while the channel waits as on a full Redis."""
    return time.monotonic() < float(channel.full_until)


class FullRedis:
    """kombu's Redis channel methods a worker needs on a full Redis (mixed in before kombu's Channel)."""

    #: Monotonic time until which the channel waits as on a full Redis (`refused`).
    full_until = 0.0
    #: Bindings skipped on a full Redis (kombu's `_queue_bind` arguments), bound once it has room.
    _unbound: list[tuple[str, str, str, str]] | None = None

    def _queue_bind(self: Any, exchange: str, routing_key: str, pattern: str, queue: str) -> Any:
        try:
            return super()._queue_bind(exchange, routing_key, pattern, queue)  # type: ignore[misc]  # kombu Channel
        except redis.exceptions.ResponseError as exc:
            if not is_oom(exc):
                raise
            member = self.sep.join([routing_key or "", pattern or "", queue or ""])
            with self.conn_or_acquire() as client:
                if client.sismember(self.keyprefix_queue % (exchange,), member):
                    return None  # in place: nothing to write
            if exchange != REPLY_EXCHANGE:  # a reply queue is declared again by the next broadcast
                self._unbound = [*(self._unbound or ()), (exchange, routing_key, pattern, queue)]
            STATE.refused(_binding(exchange, queue), exc)
            return None

    def _delete(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._delete(queue, *args, **kwargs)  # type: ignore[misc]  # kombu Channel
        except redis.exceptions.ResponseError as exc:
            if not is_oom(exc):
                raise
            STATE.refused("kombu's delete of a reply or auto-delete queue (a MULTI)", exc)
            return None

    def maybe_refresh_binding_expiry(self: Any) -> Any:
        if STATE.check_due():
            with self.conn_or_acquire() as client:
                if has_room(client):
                    STATE.room()
        if STATE.full:
            return None  # kombu's refresh (a MULTI of scripts that grow memory) waits for room
        unbound, self._unbound = self._unbound, None
        for binding in unbound or ():
            self._queue_bind(*binding)  # skipped again (and kept) if Redis filled meanwhile
        return super().maybe_refresh_binding_expiry()  # type: ignore[misc]  # kombu Channel

    def _size(self: Any, queue: str) -> int:
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for pri in self.priority_steps:
                pipe.llen(self._q_for_pri(queue, pri))
            return sum(int(size) for size in pipe.execute())


def _binding(exchange: str, queue: str) -> str:
    """The binding of `queue` to `exchange` as the log names it (one name per kind of binding: said once)."""
    if exchange == REPLY_EXCHANGE:
        return "the binding of this worker's reply queue (broadcasts it sends, mingle's, get no replies)"
    if exchange.endswith(".pidbox"):
        return f"the binding of its remote-control mailbox to {exchange} (remote control does not reach this worker)"
    if exchange == "celeryev":
        return "the binding of its gossip queue to celeryev (other workers' events are not received)"
    return f"the binding of queue {queue} to {exchange} (the worker consumes it all the same)"
