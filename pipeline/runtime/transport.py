"""The worker's Redis transport: `pipeline.dlq.transport` (non-messages dead-lettered), made to survive a Redis
restart under load. Workers select it (`pipeline.runtime.worker` sets `broker_transport` to the class path
`pipeline.config.celery.worker_broker_transport` gives); producers, beat and Flower keep kombu's own.

What goes wrong in kombu 5.7 (`kombu/transport/redis.py`, `kombu/transport/virtual/base.py`,
`kombu/connection.py`) when Redis restarts while a worker holds unacknowledged jobs:

1. The consumer's connection is closed: `Connection._do_close_self` → `Transport.close_connection`
   closes each channel; `Channel.close` drops its pools (`_disconnect_pools`) and then, in the virtual
   `Channel.close`, `QoS.restore_unacked_once` puts the jobs the channel delivered back on their queues.
   With Redis still down that restore raises `ConnectionError`; `close_connection` gives up on the
   remaining channels (`kombu/connection.py` swallows the error), and the jobs the failed restore held are
   marked restored all the same: they stay in the `unacked` hash until `visibility_timeout` (hours).
2. `Connection._do_close_transport` then sets `transport.client = None`. A channel closed after that
   (one `close_connection` skipped, closed by the consumer's restart or by its `Finalize` at collection)
   restores through a new pool, and `Channel._connparams` reads `self.connection.client.hostname`:
   `AttributeError: 'NoneType' object has no attribute 'hostname'`. It is not a connection error, so it
   escapes Celery's consumer restart loop and the worker stops with "Unrecoverable error".

The fix, in a `QoS`/`Channel` subclass:

- `Channel._connparams` on a closed connection raises a connection error instead (recoverable; Celery
  reconnects), and
- a restore that fails on a connection error keeps the delivery tags of the jobs it could not put back;
  the next channel's periodic sweep (`restore_visible`, every `unacked_restore_interval`) restores them
  with kombu's own `restore_by_tag` (a WATCHed transaction on the `unacked` hash: a job that was acked,
  or restored by another worker's sweep, meanwhile is left alone). So nothing waits out the visibility
  timeout and nothing is restored twice.

3. An acknowledgement made while Redis is away (a job that finished as the connection dropped) fails in
   `QoS.ack` → `_remove_from_indices` before kombu forgets the delivery (`virtual.QoS.ack`), so the job
   stays in `unacked`, is restored on reconnect and runs again. The fix remembers such an acknowledgement
   (the job is done: it is not restored) and applies it on the next channel's sweep, before any restore.

It relies on `worker_cancel_long_running_tasks_on_connection_loss` (set in `pipeline.config.celery`): a
job still running when its connection dropped is terminated, so the restored copy never runs beside it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual

from pipeline.dlq import transport as dead_lettering

log = logging.getLogger(__name__)

#: Delivery tags whose restore failed because Redis was away: restored by the next channel's sweep.
_pending: set[str] = set()
_pending_lock = threading.Lock()
#: Delivery tags acknowledged while Redis was away: removed from `unacked` by the next channel's sweep.
_acked: set[str] = set()


def pending_restores() -> int:
    with _pending_lock:
        return len(_pending)


def pending_acks() -> int:
    with _pending_lock:
        return len(_acked)


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client: Any = None) -> Any:
        try:
            return super().restore_unacked(client)
        except self._channel().connection_errors as exc:
            delivered = self._delivered
            with _pending_lock:
                tags = [tag for tag in delivered or () if tag not in _acked]
                _pending.update(tags)
            if delivered is not None:
                delivered.clear()
            log.warning(
                "could not restore %d unacknowledged job(s) now (%r); restoring them on reconnect", len(tags), exc
            )
            return None

    def _channel(self) -> Any:
        return self.channel

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> Any:
        self._apply_acks()  # first: a job acknowledged while Redis was away is done, never restored
        self._restore_pending()
        return super().restore_visible(start, num, interval)

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except self._channel().connection_errors as exc:
            self._remember_ack(delivery_tag, exc)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            self.ack(delivery_tag)  # kombu's reject without requeue is the same removal as ack
            return
        super().reject(delivery_tag, requeue=True)  # a failed requeue leaves it unacknowledged: restored later

    def _remember_ack(self, delivery_tag: str, exc: BaseException) -> None:
        with _pending_lock:
            _acked.add(delivery_tag)
            _pending.discard(delivery_tag)
        kombu_virtual.QoS.ack(self, delivery_tag)  # forgotten here, so this channel's restore skips it
        if self._delivered is not None:
            self._flush()  # type: ignore[attr-defined]  # kombu virtual.QoS: drop acked tags from _delivered
        log.warning("could not acknowledge a job now (%r); acknowledging it on reconnect", exc)

    def _apply_acks(self) -> None:
        with _pending_lock:
            tags = list(_acked)
        if not tags:
            return
        with self._channel().conn_or_acquire() as client:
            for tag in tags:
                remove = self._remove_from_indices  # type: ignore[attr-defined]  # kombu_redis.QoS, untyped
                remove(tag, client.pipeline()).execute()  # a connection error leaves the rest for the next sweep
                with _pending_lock:
                    _acked.discard(tag)
        log.info("applied %d acknowledgement(s) made while the broker was unreachable", len(tags))

    def _restore_pending(self) -> None:
        with _pending_lock:
            tags = [tag for tag in _pending if tag not in _acked]
        if not tags:
            return
        with self._channel().conn_or_acquire() as client:
            for tag in tags:
                self.restore_by_tag(tag, client)  # a connection error leaves the rest for the next sweep
                with _pending_lock:
                    _pending.discard(tag)
        log.info(
            "restored %d delivery tag(s) a lost connection left unacknowledged (acknowledged ones are skipped)",
            len(tags),
        )


class _Guarded:
    connection: Any

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:  # closed: kombu cleared it
            raise redis.exceptions.ConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]


class Channel(_Guarded, dead_lettering.Channel):
    QoS = QoS


class Transport(dead_lettering.Transport):
    Channel = Channel


class SentinelChannel(_Guarded, dead_lettering.SentinelChannel):
    QoS = QoS


class SentinelTransport(dead_lettering.SentinelTransport):
    Channel = SentinelChannel
