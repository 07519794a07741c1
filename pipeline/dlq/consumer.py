"""The worker's consumer, extended so that a message whose body cannot be decoded is dead-lettered.

Celery acknowledges and drops such a message with only a CRITICAL log line and no signal; this
subclass publishes an envelope (with a preview of the raw body) before Celery drops it.
Installed by `worker_consumer` in `pipeline.config.celery_conf`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer

from pipeline.dlq.capture import from_message
from pipeline.observability import metrics

log = logging.getLogger(__name__)


class DeadLetteringConsumer(Consumer):
    def on_decode_error(self, message: Any, exc: Exception) -> None:
        try:
            from_message("undecodable", message, exc)
        except Exception:
            metrics.signal_handler_errors.labels(handler="on_decode_error").inc()
            log.exception("could not dead-letter an undecodable message")
        super().on_decode_error(message, exc)
