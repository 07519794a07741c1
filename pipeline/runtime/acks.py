"""Acknowledgements made on the worker's event loop, written together: carried by the next fetch, or at the next tick.

A job's acknowledgement (late, after the job) is one fenced Lua call (`pipeline.runtime.lease.ACK`) and, made
synchronously, one blocking round trip of the worker's main process per job. `DeferredAcks` (mixed into the
transport's QoS) instead frees kombu's prefetch slot at once and keeps the tag:

- while the channel fetches (a fetch is in flight, or kombu's `on_poll_start`, a tick callback, is about to send
  one), the next fetch script acknowledges them first, in the same call (`pipeline.runtime.fetch.FETCH`): no
  round trip of their own. A fetch in flight is answered within a fraction of a millisecond, and its reply wakes
  the loop, which sends the next fetch at once;
- otherwise (the channel waits on an empty queue, or the prefetch is full) `flush_acks`, a tick callback of
  kombu's hub, writes them all with one `lease.ACK_MANY` call before the loop polls again.

A solo worker runs each job inside the delivery (`pipeline.runtime.fetch.deliver`), which writes the deferred
acknowledgements before it hands over the next job. So an acknowledgement reaches Redis within a loop
iteration or two of its job's end: a worker killed in that window (about a millisecond) runs the job again
after its lease, as a worker killed just before a synchronous acknowledgement would. The delivery stays
leased (held and renewed) until then. Acknowledgements made off the loop thread (no hub, or a pool thread) stay
synchronous. One that cannot reach Redis is remembered (`lease.remember_ack`) and applied, fenced, by the
renewal thread; so is one a fetch carried when its reply was lost (it may have been applied: a second fenced
acknowledgement of a removed delivery removes nothing, and is logged as fenced).
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from kombu.asynchronous import get_event_loop

from pipeline.runtime import lease


def loop_hub() -> Any:
    """The event loop (kombu's hub) when called on its thread, else None."""
    hub = get_event_loop()
    if hub is None or getattr(hub, "_loop_thread", None) != threading.get_ident():
        return None
    return hub


class DeferredAcks:
    """The deferral, mixed into the transport's QoS (which gives `channel` and `_fenced_ack`)."""

    channel: Any
    _deferred_acks: list[str] | None = None
    _ack_client: Any = None
    #: Acknowledgements deferred so far (the delivery loop compares it to see a job end inside a delivery).
    acks_deferred = 0

    def _fenced_ack(self, delivery_tag: str) -> None:
        raise NotImplementedError

    def ack_now_or_defer(self, delivery_tag: str) -> None:
        hub = loop_hub()
        if hub is None:
            self._fenced_ack(delivery_tag)
            return
        if self._deferred_acks is None:
            self._deferred_acks = []
        self._deferred_acks.append(delivery_tag)
        self.acks_deferred += 1
        hub.on_tick.add(self.flush_acks)

    def take_acks(self) -> list[str]:
        """The deferred acknowledgements, for a fetch to carry."""
        tags, self._deferred_acks = self._deferred_acks or [], None
        return tags

    def flush_acks(self, carry: bool = True) -> None:
        """Write the deferred acknowledgements in one fenced call, unless (`carry`) a fetch can carry them: one
        about to be sent in this loop iteration, or the next one after the fetch in flight (its reply wakes the
        loop). Left for a fetch, they are looked at again at each tick until one took them."""
        if self._deferred_acks and carry and self.channel._fetch_soon():
            return
        hub: Any = get_event_loop()
        if hub is not None:
            hub.on_tick.discard(self.flush_acks)
        tags = self.take_acks()
        if not tags:
            return
        try:
            if self.channel.closed or self.channel.connection is None:
                raise redis.exceptions.ConnectionError("the channel is closed")
            if self._ack_client is None:
                self._ack_client = self.channel._create_client()
            lease.ack_many(self._ack_client, tags)
        except self.channel.connection_errors as exc:
            remember(tags, exc)


def remember(tags: list[str], exc: BaseException) -> None:
    """Acknowledgements whose outcome is unknown: applied (fenced) by the renewal thread."""
    for tag in tags:
        lease.remember_ack(tag, exc)
