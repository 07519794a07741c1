"""The worker's consumer, extended so that every message it refuses is dead-lettered before Celery logs it.

Celery logs a refused message (unregistered task, invalid or disallowed content, an undecodable body,
not a task at all) with its whole body, then drops it; for an undecodable body it sends no signal.
This subclass publishes the envelope first and lets Celery handle the message inside
`payloads.refused_message(entry_id)`: Celery's log line then names the dead-letter entry instead of
the body (`pipeline.observability.payloads`), and the signal handlers, which run inside that block,
do not dead-letter the message a second time. Installed by `worker_consumer` in `pipeline.config.celery`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.worker.consumer import Consumer

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
