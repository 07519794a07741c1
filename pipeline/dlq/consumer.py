"""The worker's consumer, extended so that every message it refuses is dead-lettered before Celery logs it.

Celery logs a refused message (unregistered task, invalid or disallowed content, an undecodable body,
not a task at all) with its whole body, then drops it; for an undecodable body it sends no signal.
This subclass publishes the envelope first and lets Celery handle the message inside
`payloads.refused_message(entry_id)`: Celery's log line then names the dead-letter entry instead of
the body (`pipeline.observability.payloads`), and the signal handlers, which run inside that block,
do not dead-letter the message a second time. Installed by `worker_consumer` in `pipeline.config.celery`.

Poison input never takes the worker down: every message first goes through `poison.problem` (a body
that is not `[args, kwargs, embed]`, headers without a task id, a body over the size limit are refused
as invalid), and anything else Celery's task handler raises for a message it has not acknowledged is
refused the same way instead of stopping the consumer (`celery/worker/consumer/consumer.py`,
`Consumer.create_task_handler`, handles only InvalidTaskError, ContentDisallowed and DecodeError).
A message delivered from the dead-letter queue is never handled: it is put back unchanged and the
worker stops consuming that queue.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.worker.consumer import Consumer
from kombu import Exchange, Queue
from kombu.utils.json import dumps
from vine import promise

from pipeline.broker import broker_redis
from pipeline.compat.message import raw_envelope
from pipeline.config import get_settings
from pipeline.constants import DEAD_LETTER_QUEUE, DELIVERY_HEADERS
from pipeline.dlq import poison
from pipeline.dlq.capture import from_message
from pipeline.dlq.envelope import Reason
from pipeline.observability import metrics, payloads

log = logging.getLogger(__name__)


@contextmanager
def _dead_lettered(handler: str, reason: Reason, message: Any, exc: BaseException | None) -> Iterator[None]:
    entry_id = None
    try:
        entry_id = from_message(reason, message, exc)
    except Exception:
        metrics.signal_handler_errors.labels(handler=handler).inc()
        log.exception("could not dead-letter a refused message (%s)", reason)
    with payloads.refused_message(entry_id):
        yield


class DeadLetteringConsumer(Consumer):
    def on_unknown_message(self, body: Any, message: Any) -> None:
        with _dead_lettered("on_unknown_message", "rejected", message, None):
            super().on_unknown_message(body, message)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        with _dead_lettered("on_unknown_task", "unknown_task", message, exc):
            super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        with _dead_lettered("on_invalid_task", "rejected", message, exc):
            super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        with _dead_lettered("on_decode_error", "undecodable", message, exc):
            super().on_decode_error(message, exc)

    def create_task_handler(self, promise: Any = promise) -> Any:
        handle = super().create_task_handler(promise)
        limit = poison.body_limit(get_settings().max_payload_bytes)
        recoverable = tuple(getattr(self, "connection_errors", ())) + tuple(getattr(self, "channel_errors", ()))

        def on_task_received(message: Any) -> None:
            if poison.from_dead_letter_queue(message.delivery_info):
                return self._leave_dead_letter(message)
            refused = poison.problem(message, limit)
            if refused is not None:
                return self.on_invalid_task(None, message, refused)
            try:
                return handle(message)  # type: ignore[no-any-return]
            except recoverable:
                raise
            except Exception as exc:
                if message.acknowledged:
                    log.exception("error after the message was handled")
                    return None
                return self.on_invalid_task(None, message, exc)

        return on_task_received

    def add_task_queue(
        self,
        queue: str | Queue,
        exchange: str | Exchange | None = None,
        exchange_type: str | None = None,
        routing_key: str | None = None,
        **options: Any,
    ) -> Any:
        # Called by the `add_consumer` control command, soon after its reply (`celery/worker/control.py`):
        # an exception here would stop the worker, so the request is refused with a log line.
        if (queue.name if isinstance(queue, Queue) else queue) == DEAD_LETTER_QUEUE:
            log.error("refusing to consume the dead-letter queue %r (add_consumer ignored)", DEAD_LETTER_QUEUE)
            return None
        return super().add_task_queue(queue, exchange, exchange_type, routing_key, **options)

    def _leave_dead_letter(self, message: Any) -> None:
        """Put an envelope back where it was (the list's consuming end), byte for byte, and stop consuming it.

        kombu's own requeue (`reject(requeue=True)`) would mark it redelivered, changing the stored element
        the dead-letter index points at, and push it to the other end of the list.
        """
        log.error("refusing to consume the dead-letter queue %r: its envelopes are left in place", DEAD_LETTER_QUEUE)
        raw = dict(raw_envelope(message))
        if isinstance(raw.get("headers"), dict):  # the worker transport added them after the fetch: not stored
            raw["headers"] = {k: v for k, v in raw["headers"].items() if k not in DELIVERY_HEADERS}
        with broker_redis() as client:
            client.rpush(DEAD_LETTER_QUEUE, dumps(raw))
        message.ack()
        task_consumer = getattr(self, "task_consumer", None)
        if task_consumer is not None and task_consumer.consuming_from(DEAD_LETTER_QUEUE):
            self.cancel_task_queue(DEAD_LETTER_QUEUE)
