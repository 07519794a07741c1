"""A worker on a full Redis: `maxmemory` reached with policy `noeviction` (what a queue must run with).

At maxmemory Redis refuses every command that may grow memory (`denyoom`), every command queued in a MULTI (reads
included), and a script whose first write may grow memory; a script whose first write frees memory runs to its
end. The delivery scripts are written that way (`pipeline.lua`: fetch, settle, store, renew, release), so the
workers drain the backlog that filled Redis. What else a worker sends is handled here:

- the wait on an empty queue (`BLMOVE`, denyoom) is refused: for WAIT_S after a refusal the channel waits with
  `BRPOP` on WAIT_KEY, a key nothing writes (a pause Redis runs at maxmemory), and says so once, never as a lost
  connection (`refused`, `waiting`);
- kombu's queue size (`Channel._size`, asked as Celery declares each queue) is read without MULTI;
- kombu's binding write (`Channel._queue_bind`, SADD) is refused even when the binding is there: a binding in place
  is kept as it is, so a worker (re)started on a full Redis consumes; a broadcast binding that is not there (Celery's
  remote control of this worker) is skipped with a WARNING until the worker restarts with room.

Not handled: kombu's sweep of expired leases and a holder's requeue are MULTIs, refused until Redis has room again
(`pipeline.delivery.transport.QoS.restore_visible` says so and tries again at its next sweep).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from pipeline.broker import is_oom

log = logging.getLogger("pipeline.delivery.transport")

#: How long a channel waits with BRPOP on WAIT_KEY after Redis refused a command for memory (seconds).
WAIT_S = 5.0
WAIT_KEY = "pipeline:full-wait"


def refused(channel: Any, exc: BaseException) -> None:
    """Redis refused a channel's command for memory: what a fetch carried was not applied (a script refused at its
    first write writes nothing); the channel waits with BRPOP for WAIT_S, and fetches next."""
    channel._settle_carried(exc)
    now = time.monotonic()
    if now >= channel.full_until:
        log.warning("Redis is at maxmemory (%s): waiting with BRPOP while the backlog drains", exc)
    channel.full_until = now + WAIT_S
    channel._empty = False


def waiting(channel: Any) -> bool:
    """True while the channel waits as on a full Redis."""
    return time.monotonic() < float(channel.full_until)


class FullRedis:
    """kombu's Redis channel methods a worker needs on a full Redis (mixed in before kombu's Channel)."""

    #: Monotonic time until which the channel waits as on a full Redis (`refused`).
    full_until = 0.0

    def _queue_bind(self: Any, exchange: str, routing_key: str, pattern: str, queue: str) -> Any:
        try:
            return super()._queue_bind(exchange, routing_key, pattern, queue)  # type: ignore[misc]  # kombu Channel
        except redis.exceptions.ResponseError as exc:
            if not is_oom(exc):
                raise
            member = self.sep.join([routing_key or "", pattern or "", queue or ""])
            with self.conn_or_acquire() as client:
                if client.sismember(self.keyprefix_queue % (exchange,), member):
                    log.warning("Redis is at maxmemory: binding %s of queue %s kept as it is", exchange, queue)
                    return None
            if self.typeof(exchange).type != "fanout":
                raise
            log.warning("Redis is at maxmemory: %s not bound; remote control will not reach this worker", queue)
            return None

    def _size(self: Any, queue: str) -> int:
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for pri in self.priority_steps:
                pipe.llen(self._q_for_pri(queue, pri))
            return sum(int(size) for size in pipe.execute())
