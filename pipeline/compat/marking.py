"""kombu's Redis publish and restore with the queue's wake-up marker (`pipeline.queues.wake`) in the same round trip.

kombu 5.7's `Channel._put` LPUSHes the envelope on the key of the message's priority (`_q_for_pri`,
`_get_message_priority`) and PEXPIREs the queue's keys when it has an expiry (`_expires`); a recorded publish
(`_publish_batch`: `pipeline.compat.batch`) is handed to the batch instead. `Marked._put` sends kombu's commands and
the queue's marker in one MULTI, so an idle worker of the queue wakes at once; a recorded publish (whose writer,
`pipeline.producer`, adds the marker) and a control reply (no marker: no worker waits on one) stay kombu's own.
`_do_restore_message` pushes on the pipe it is given (`pipe.lpush`/`pipe.rpush`): each push there is followed by
the marker, on the same pipe.

Mixed into the worker transport's channel (`pipeline.delivery.transport`: a retry or a rate-limit deferral sent from
a worker, a requeue, a sweep's restore) and into beat's (`Transport`, `SentinelTransport`: what
`pipeline.compat.redbeat.Scheduler` sends cron jobs through). Other producers keep kombu's own transport.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from pipeline.queues import wake


class _Marking:
    """Stands in for the pipe kombu's `_do_restore_message` pushes on: each push also marks its queue."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def lpush(self, key: str, *values: Any) -> None:
        self._pipe.lpush(key, *values)
        wake.mark(self._pipe, key)

    def rpush(self, key: str, *values: Any) -> None:
        self._pipe.rpush(key, *values)
        wake.mark(self._pipe, key)


class Marked:
    """kombu's `_put` and `_do_restore_message` with the queue's marker (mixed in before kombu's Redis channel)."""

    def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        if kwargs.get("_publish_batch") is not None or wake.silent(queue):
            super()._put(queue, message, **kwargs)  # type: ignore[misc]  # kombu's Channel, after this mixin
            return
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            pipe.lpush(key, dumps(message))
            if self._expires and queue in self._expires:
                for pri in self.priority_steps:
                    pipe.pexpire(self._q_for_pri(queue, pri), self._expires[queue])
            wake.mark(pipe, key)
            pipe.execute()

    def _do_restore_message(
        self: Any, payload: Any, exchange: str, routing_key: str, pipe: Any, leftmost: bool = False
    ) -> None:
        super()._do_restore_message(payload, exchange, routing_key, _Marking(pipe), leftmost)  # type: ignore[misc]


class Channel(Marked, kombu_redis.Channel):
    pass


class SentinelChannel(Marked, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def transport(sentinel: bool) -> str:
    """The class path of the marking transport (`broker_transport`, or a connection's `transport=`)."""
    return f"{__name__}:{'SentinelTransport' if sentinel else 'Transport'}"
