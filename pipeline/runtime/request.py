"""The worker's job request: a delivery whose lease was lost is neither run nor acknowledged, stored or dead-lettered.

`pipeline.runtime.lease` records the delivery tags whose lease a peer took (this worker was frozen or cut off
for longer than a lease and the job was restored for another worker). Celery's per-task request class
(`celery/worker/request.py: create_request_cls`) replaces `execute_using_pool` but still asks `revoked()`
first, so `revoked()` is where a lost delivery is refused: it is dropped without running (its in-memory
prefetch slot freed, nothing acknowledged in Redis), and `TaskRevokedError` tells the
worker nothing ran (`celery/worker/worker.py: WorkController._process_task`). Unlike a revoke, no REVOKED
state is stored: the peer's result must stand.

A running job found lost is terminated by `pipeline.runtime.fencing`; its child's death is then not a
failure here (`on_failure` returns), as for a job Celery cancelled at shutdown (`Consumer.cancel_active_requests`
passes `emit_retry=False` for late-acknowledged jobs, "since broker will handle redelivery").
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery.worker.request import Request as CeleryRequest
from celery.worker.state import task_ready
from kombu.transport import virtual as kombu_virtual

from pipeline.runtime import lease

log = logging.getLogger(__name__)

#: What `Task.Request` names: the worker's strategy resolves it per task (`celery/worker/strategy.py`).
REQUEST_CLASS = "pipeline.runtime.request:Request"


def delivery_tag(request: Any) -> str | None:
    message = getattr(request, "_message", None)
    tag = getattr(message, "delivery_tag", None)
    return None if tag is None else str(tag)


def drop_lost(request: Any) -> None:
    """Forget a request whose lease was lost: not run, nothing stored, nothing acknowledged in Redis (the delivery
    is a peer's, or this worker's again if it fetched it anew); only kombu's in-memory prefetch slot is freed."""
    request._lease_lost = True
    task_ready(request)
    message = getattr(request, "_message", None)
    if not request.acknowledged and message is not None:
        request.acknowledged = True
        with contextlib.suppress(Exception):  # a channel already closed holds no slot
            kombu_virtual.QoS.ack(message.channel.qos, message.delivery_tag)
    tag = delivery_tag(request)
    if tag is not None:
        lease.forget_lost([tag])
    log.warning("job %s[%s]: lease lost to another worker; not run here", request.name, request.id)


class Request(CeleryRequest):
    _lease_lost = False

    def revoked(self) -> bool:
        if lease.is_lost(delivery_tag(self)):
            drop_lost(self)
            return True
        return bool(super().revoked())

    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any, expired: Any) -> None:
        if self._lease_lost:  # terminated by the fence: no REVOKED state over the peer's result
            task_ready(self)
            return
        super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]  # untyped in celery-types

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        if self._lease_lost or (getattr(self, "_already_cancelled", False) and self.task.acks_late):
            # The child died of our terminate (lease lost) or of a cancel at shutdown: not a failure, not a
            # revoke. Nothing stored, nothing dead-lettered: the job is a peer's, or goes back to its queue.
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
