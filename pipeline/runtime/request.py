"""The worker's job request: time limits a message cannot raise, and a delivery limit.

* **Time limits.** Celery runs a job with the limits its message carries (`timelimit` header, `[hard, soft]`),
  unbounded: a foreign client's `send_task(..., time_limit=86400)` would hold a pool process a day. Here each
  is capped by the task's own limit (TASK_TIME_LIMIT / TASK_SOFT_TIME_LIMIT, TRANSCODE_* for transcodes: what
  the worker allows for that queue); a message asking for more is clamped and logged. Shorter limits stand.
* **Delivery limit.** The worker's transport counts every delivery of a message, redeliveries after a dead
  worker included (which Celery's `retries` does not see), in the `x-delivery-count` header. A message
  delivered more than MAX_DELIVERIES times is not run: it is stored as FAILURE (`DeliveryLimitExceeded`),
  dead-lettered with reason `delivery_limit` and its delivery history (when, which worker), and acknowledged.
  A job that takes its whole worker down (out of memory, a native crash) would otherwise come back once per
  lease, forever. The check sits in `revoked()`, which Celery calls right before a request goes to the pool
  (`execute_using_pool`, also in the per-task subclass `celery/worker/request.py: create_request_cls` builds),
  so a job dead-lettered here ends like a revoked one: `TaskRevokedError` is handled by the worker.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from celery.worker.request import Request as CeleryRequest
from celery.worker.state import task_ready

from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.constants import DELIVERY_LOG_KEY, HEADER_DELIVERY_COUNT
from pipeline.dlq import capture
from pipeline.errors import DeliveryLimitExceeded

log = logging.getLogger(__name__)

#: What `Task.Request` names: the worker's strategy resolves it per task (`celery/worker/strategy.py`).
REQUEST_CLASS = "pipeline.runtime.request:Request"


def _cap(value: Any, cap: float | None) -> Any:
    if value is None or cap is None:
        return value
    return min(value, cap)


def delivery_count(headers: dict[str, Any]) -> int | None:
    """The message's delivery count (1 on the first delivery), or None when it carries none."""
    raw = headers.get(HEADER_DELIVERY_COUNT)
    try:
        return int(raw) if raw is not None and not isinstance(raw, bool) else None
    except (TypeError, ValueError):
        return None


def delivery_history(tag: str) -> list[dict[str, Any]]:
    """The recorded deliveries of delivery tag `tag`, oldest first: {"at": ISO time, "worker": name}."""
    try:
        with broker_redis() as client:
            raw = client.lrange(DELIVERY_LOG_KEY.format(tag=tag), 0, -1)
    except Exception:  # the history is an aid; the entry is written without it
        log.warning("could not read the delivery history of %s", tag, exc_info=True)
        return []
    history = []
    for item in raw:
        try:
            entry = json.loads(item)
            at = datetime.fromtimestamp(float(entry["at"]), UTC).isoformat()
            history.append({"at": at, "worker": str(entry.get("worker", ""))[:200]})
        except (ValueError, TypeError, KeyError):
            continue
    return history


class Request(CeleryRequest):
    def __init__(self, message: Any, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self._delivery_limited = False
        self._clamp_time_limits()

    def _clamp_time_limits(self) -> None:
        asked = self.time_limits  # the message's [hard, soft]; (None, None) when it carried none
        if not asked or len(asked) != 2:
            return
        hard, soft = asked
        allowed = (_cap(hard, self.task.time_limit), _cap(soft, self.task.soft_time_limit))
        if allowed != (hard, soft):
            log.warning(
                "job %s (%s) asked for time limits hard=%s soft=%s; clamped to hard=%s soft=%s, the most this worker"
                " allows for the task",
                self.id,
                self.name,
                hard,
                soft,
                *allowed,
            )
            self.time_limits = allowed

    def revoked(self) -> bool:
        return self._over_delivery_limit() or bool(super().revoked())

    def _over_delivery_limit(self) -> bool:
        if self._delivery_limited:
            return True
        count = delivery_count(self.request_dict)
        limit = get_settings().max_deliveries
        if count is None or count <= limit:
            return False
        self._delivery_limited = True
        exc = DeliveryLimitExceeded(
            f"delivered {count} times, more than MAX_DELIVERIES={limit}; no earlier delivery ended with an outcome"
            " (the worker holding it stopped each time)"
        )
        try:
            context = self._context  # type: ignore[attr-defined]  # Celery's cached_property, untyped
            self.task.backend.mark_as_failure(self.id, exc, request=context, store_result=True)
            capture.from_delivery_limit(
                self.message, self.type, self.id, exc, count, delivery_history(str(self.message.delivery_tag))
            )
        except Exception:  # not dead-lettered: put it back, to be tried again on its next delivery
            log.exception("could not dead-letter job %s over its delivery limit; it goes back to its queue", self.id)
            task_ready(self)
            self.reject(requeue=True)
            return True
        task_ready(self)
        self.send_event("task-failed", exception=repr(exc), traceback="")
        self.acknowledge()
        return True

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        if self.task.acks_late:
            emit_retry = False  # no backend write while the broker is away; its message comes back instead
        super().cancel(pool, signal, emit_retry=emit_retry)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        if getattr(self, "_already_cancelled", False) and self.task.acks_late:
            # The child died of our cancel (Terminated, SystemExit or a lost worker alike): not a failure, not a
            # revoke. Leave the message unacknowledged; it is delivered again.
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
