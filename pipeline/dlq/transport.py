"""kombu's Redis transport, extended so that bytes in a queue that are not a message never stop a worker.

kombu decodes each list element it pops as its JSON message envelope and hands it on unguarded
(`kombu/transport/redis.py`: `Channel._brpop_read` calls `loads(bytes_to_str(item))`, `Channel._get`
likewise; `kombu/transport/virtual/base.py`: `Channel.basic_consume._callback` builds a `Message` that
reads `payload['properties']['delivery_tag']`). Raw bytes LPUSHed onto a queue (not JSON, or JSON that
is not kombu's envelope) raise there: the worker exits and the popped element is gone. `Channel` below
checks each popped element first; one that is not a message becomes a dead-letter entry with reason
`undecodable` (a bounded preview, its size and sha256, `pipeline.dlq.capture.from_raw`), and the
worker goes on consuming.

Workers consume through `pipeline.runtime.transport`, which builds on these classes (and survives Redis
restarts); producers, beat and Flower keep kombu's own.
"""

from __future__ import annotations

import logging
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from pipeline.dlq.capture import from_raw
from pipeline.observability import metrics

log = logging.getLogger(__name__)


class UndecodableMessage(ValueError):
    """A queue element is JSON but not a broker message envelope."""


class _Checked:
    """The checks shared by the plain and the Sentinel channel (a mixin over kombu's Redis `Channel`)."""

    def _decode_element(self: Any, item: bytes, queue: str) -> dict[str, Any] | None:
        """The envelope in `item`, or None once a poison element has been dead-lettered."""
        try:
            payload = loads(bytes_to_str(item))
            if not isinstance(payload, dict):
                raise UndecodableMessage(f"a JSON {type(payload).__name__}, not a message envelope")
            message = self.Message(payload, channel=self)  # what basic_consume's callback builds first
            delivery = message.delivery_info
            if not isinstance(delivery, dict) or "exchange" not in delivery or "routing_key" not in delivery:
                raise UndecodableMessage("the envelope has no delivery info")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # base64, JSON, a missing or mistyped field
            dead_letter(item, queue, exc)
            return None
        return payload

    # A copy of kombu 5.7's `Channel._brpop_read` with the element checked before it is delivered.
    def _brpop_read(self: Any, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            payload = self._decode_element(item, dest)
            if payload is not None:
                self.connection._deliver(payload, dest)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    # A copy of kombu 5.7's `Channel._get` (the synchronous path: `basic_get`, `drain_events` without a hub).
    def _get(self: Any, queue: str, timeout: float | None = None) -> Any:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    payload: dict[str, Any] | None = self._decode_element(item, queue)
                    if payload is None:
                        raise Empty()
                    return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()


def dead_letter(item: bytes, queue: str, exc: Exception) -> None:
    raw = item if isinstance(item, bytes) else str(item).encode("utf-8", "replace")
    try:
        entry_id = from_raw(raw, queue, exc)
    except Exception:
        metrics.signal_handler_errors.labels(handler="undecodable_element").inc()
        log.exception("could not dead-letter an undecodable element of queue %s (%d bytes)", queue, len(raw))
        return
    log.error(
        "queue %s held an element that is not a message (%s): discarded, dead-lettered as %s",
        queue,
        type(exc).__name__,
        entry_id,
    )


class Channel(_Checked, kombu_redis.Channel):
    pass


class SentinelChannel(_Checked, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
