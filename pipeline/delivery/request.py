"""The worker's job request: leases, cancels, time limits a message cannot raise, and a delivery limit.

* **Lost leases.** The worker's `Leases` (`pipeline.delivery.lease`) record the delivery tags whose lease a peer
  took (this worker was frozen or cut off for longer than a lease and the job was restored for another worker).
  Celery's per-task request class (`celery/worker/request.py: create_request_cls`) replaces `execute_using_pool`
  but still asks `revoked()` first, so `revoked()` is where a lost delivery is refused: it is dropped without
  running (its in-memory prefetch slot freed, nothing acknowledged in Redis), and `TaskRevokedError` tells the worker
  nothing ran (`celery/worker/worker.py: WorkController._process_task`). Unlike a revoke, no REVOKED state is
  stored: the peer's result must stand. A running job found lost is terminated by `pipeline.delivery.fencing`;
  its child's death is then not a failure here (`on_failure` returns).
* **Leases that could not be renewed.** A job stopped before its lease lapsed unrenewed (`LeaseLost`, raised in it by
  `pipeline.runtime.lapses`; or its prefork child killed at the lapse) is abandoned (`abandon`): nothing stored,
  acknowledged, retried or dead-lettered here, its prefetch slot freed, counted in `pipeline_jobs_abandoned_total`.
* **Cancels.** `Consumer.cancel_active_requests` (shutdown) passes `emit_retry=False` for late-acknowledged
  jobs, "since broker will handle redelivery"; this request does the same for every cancel of one, and never
  acknowledges or dead-letters a job it cancelled: its message is put back on its queue. In a solo worker (the
  I/O profile), where a cold shutdown's `cancel` runs inside the running job, the job is unwound with
  `WorkerTerminate` instead of a kill the pool cannot do.
* **Time limits.** Celery runs a job with the limits its message carries (`timelimit` header, `[hard, soft]`),
  unbounded: a foreign client's `send_task(..., time_limit=86400)` would hold a pool process a day. Here each
  is capped by the task's own limit (TASK_TIME_LIMIT / TASK_SOFT_TIME_LIMIT, TRANSCODE_* for transcodes: what
  the worker allows for that queue); a message asking for more is clamped and logged. Shorter limits stand.
* **Delivery limit.** The worker's transport counts every delivery of a message, redeliveries after a dead
  worker included (which Celery's `retries` does not see), in the `x-delivery-count` header. A message
  delivered more than MAX_DELIVERIES times is not run: it is stored as FAILURE (`DeliveryLimitExceeded`),
  dead-lettered with reason `delivery_limit` and its delivery history (when, which worker), and acknowledged.
  A job that takes its whole worker down (out of memory, a native crash) would otherwise come back once per
  lease, forever. Checked in `revoked()` too, right before the request goes to the pool.
* **Cancelled jobs.** A job cancelled while a solo worker runs it is interrupted with `JobCancelled`
  (`pipeline.runtime.cancels`), Celery's `Ignore`: `on_failure` announces it revoked (REVOKED stored, read as
  `cancelled`; the revoke signal counts it; its message acknowledged), never a failure or a dead letter. One held
  and not started is refused by `revoked()` (Celery's revoked set, which the cancel listener fills).
* **Revoke with terminate.** Celery's `revoke(terminate=True)` (`celery control terminate`, Flower's button) calls
  `terminate`, routed to the stop a cancel uses (`stop_running_with`: `pipeline.runtime.cancels.CancelStep`): a job
  running in this process (the asyncio pool's, solo's) gets `JobCancelled` raised in it and is recorded as above. A
  prefork job's pool process gets Celery's signal; SIGTERM, which pool processes ignore under REMAP_SIGTERM=SIGQUIT,
  becomes their terminate signal there (SIGQUIT: the job unwinds through its `finally`).
* **One decode.** A solo worker runs the job in the process that received it: the tracer gets the body kombu
  decoded for the consumer's checks (cached on the message), not the raw bytes to decode again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from signal import SIGTERM
from typing import Any

from billiard.common import TERM_SIGNAL, TERM_SIGNAME
from celery.exceptions import WorkerTerminate
from celery.platforms import EX_OK, signals
from celery.worker.request import Request as CeleryRequest
from celery.worker.state import task_ready
from kombu.transport import virtual as kombu_virtual

from pipeline.broker import broker_redis
from pipeline.compat.events import task_events_on
from pipeline.config import get_settings
from pipeline.constants import DELIVERY_LOG_KEY, HEADER_DELIVERY_COUNT
from pipeline.delivery.lease import Leases
from pipeline.dlq import capture
from pipeline.errors import DeliveryLimitExceeded, JobCancelled, LeaseLost, WorkerStopping
from pipeline.observability import metrics
from pipeline.pools import pool_kind, traces_in_main_thread

log = logging.getLogger(__name__)

#: What `Task.Request` names: the worker's strategy resolves it per task (`celery/worker/strategy.py`).
REQUEST_CLASS = "pipeline.delivery.request:Request"


#: How a running job of this process is stopped (`pipeline.runtime.cancels.CancelStep.stop_running`, what a cancel
#: uses): True if it was found and is being stopped.
_stopper: Callable[[str], bool] | None = None


def stop_running_with(stopper: Callable[[str], bool] | None) -> None:
    """Route `Request.terminate` (Celery's revoke with terminate) to `stopper` (None: the pool's `stop_job` alone)."""
    global _stopper  # one worker per process: its cancel step sets it at start
    _stopper = stopper


def _stop_running(pool: Any, task_id: str) -> bool:
    if _stopper is not None:
        return _stopper(task_id)
    stop_job = getattr(pool, "stop_job", None)
    return stop_job is not None and bool(stop_job(task_id, JobCancelled))


def _cap(value: Any, cap: float | None) -> Any:
    if value is None or cap is None:
        return value
    return min(value, cap)


def enable_decoded_bodies() -> None:
    """A solo worker's requests hand its tracer the decoded body (`Request.decoded_bodies`)."""
    Request.decoded_bodies = True


def delivery_tag(request: Any) -> str | None:
    message = getattr(request, "_message", None)
    tag = getattr(message, "delivery_tag", None)
    return None if tag is None else str(tag)


def leases_of(request: Any) -> Leases | None:
    """The `Leases` of the worker that fetched the request's message (None when it came through kombu's own
    transport, which holds no leases)."""
    message = getattr(request, "_message", None)
    return getattr(getattr(getattr(message, "channel", None), "connection", None), "leases", None)


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


def _forget(request: Any, leases: Leases | None) -> None:
    """Take a request out of the worker's hands without a word to Redis: nothing stored or acknowledged there; only
    kombu's in-memory prefetch slot is freed, and its tag no longer counts as lost."""
    request._lease_lost = True
    task_ready(request)
    message = getattr(request, "_message", None)
    if not request.acknowledged and message is not None:
        request.acknowledged = True
        with contextlib.suppress(Exception):  # a channel already closed holds no slot
            kombu_virtual.QoS.ack(message.channel.qos, message.delivery_tag)
    tag = delivery_tag(request)
    if leases is not None and tag is not None:
        leases.forget_lost([tag])


def drop_lost(request: Any, leases: Leases) -> None:
    """Forget a request whose lease was lost: not run, nothing stored, nothing acknowledged in Redis (the delivery
    is a peer's, or this worker's again if it fetched it anew); only kombu's in-memory prefetch slot is freed."""
    _forget(request, leases)
    log.warning("job %s[%s]: lease lost to another worker; not run here", request.name, request.id)


def abandon(request: Any, leases: Leases | None) -> None:
    """Record a job stopped because its lease could not be renewed before it lapsed: nothing stored, nothing
    acknowledged in Redis (the lease lapses; a sweep puts the job back, for a peer or for this worker), no retry and no
    dead letter; kombu's in-memory prefetch slot is freed."""
    tag = delivery_tag(request)
    if leases is not None and tag is not None:
        leases.give_up([tag])  # still held when the stop reached another job than the one meant: let it lapse too
    _forget(request, leases)
    metrics.child(metrics.jobs_abandoned, request.name).inc()
    log.warning(
        "job %s[%s]: abandoned (its lease could not be renewed before it lapsed): nothing stored or acknowledged here;"
        " it runs again once the lease has lapsed",
        request.name,
        request.id,
    )


class Request(CeleryRequest):
    _lease_lost = False
    _delivery_limited = False
    #: The job runs in this process (a solo worker: `enable_decoded_bodies`), so the tracer gets the body kombu
    #: already decoded for the consumer instead of decoding it a second time.
    decoded_bodies = False

    def __init__(self, message: Any, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        if Request.decoded_bodies and getattr(self, "_content_type", None):
            # Celery's `fast_trace_task` takes a body without a content type as decoded ([args, kwargs, embed]).
            self._body = message.payload  # kombu's decode, cached on the message (the consumer's own checks read it)
            self._content_type = self._content_encoding = None
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
        leases = leases_of(self)
        if leases is not None and leases.is_lost(delivery_tag(self)):
            drop_lost(self, leases)
            return True
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

    def send_event(self, type: str, **fields: Any) -> None:
        # Celery's, without building an event the dispatcher would drop (task events off: `pipeline.compat.events`).
        eventer = getattr(self, "_eventer", None)
        if eventer and self.task.send_events and task_events_on(eventer):
            eventer.send(type, uuid=self.id, **fields)

    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any, expired: Any) -> None:
        if self._lease_lost:  # terminated by the fence: no REVOKED state over the peer's result
            task_ready(self)
            return
        super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]  # untyped in celery-types

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """Celery's revoke with terminate, and a cancel's on prefork (SIGKILL): see the module doc."""
        if self.time_start and _stop_running(pool, self.id):
            # In this process (the asyncio pool, solo): `JobCancelled` raised in it; `on_failure` records it as
            # revoked (or, for a lease lost, records nothing), its message acknowledged.
            return
        if self.time_start and traces_in_main_thread(pool):
            return  # it ended before the stop reached it (it runs nowhere else): its outcome stands
        if pool_kind(pool) == "prefork" and signals.signum(signal or TERM_SIGNAME) == SIGTERM:
            # Flower's terminate sends SIGTERM, which pool processes ignore under REMAP_SIGTERM=SIGQUIT: their own
            # terminate signal there (SIGQUIT) unwinds the job (SystemExit, its `finally` runs), as Celery's default.
            signal = TERM_SIGNAL
        super().terminate(pool, signal)

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        if self.task.acks_late:
            emit_retry = False  # no backend write while the broker is away; its message comes back instead
        if self.time_start and self.id in getattr(pool, "jobs", ()):
            # An async job of the asyncio pool (a cold shutdown, or a lease lost): stopped; nothing stored, and its
            # message goes back (or is a peer's).
            if not self._lease_lost:
                self._announce_cancelled(emit_retry=False)  # type: ignore[attr-defined]  # Celery's own; not in celery-types
            pool.stop_job(self.id, JobCancelled)
            return
        if (
            self.time_start
            and traces_in_main_thread(pool)  # the job runs in the main thread, where a cold shutdown's handler runs
            and threading.current_thread() is threading.main_thread()
        ):
            # Celery would ask the pool to kill the job, which the solo pool cannot (NotImplementedError, raised
            # in the job: a failure, dead-lettered). The job is running below this very call: unwind it without
            # a failure, as a killed child would be; its message is put back when the worker closes its connection.
            self._announce_cancelled(emit_retry=False)  # type: ignore[attr-defined]  # Celery's own; not in celery-types
            raise WorkerTerminate(EX_OK)
        super().cancel(pool, signal, emit_retry=emit_retry)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # prefork wraps it (ExceptionWithTraceback)
        if isinstance(exc, LeaseLost) or getattr(self, "_lease_lapsing", False):
            abandon(self, leases_of(self))  # stopped before its lease lapsed (`pipeline.runtime.lapses`)
            return
        if isinstance(exc, WorkerStopping) or (
            getattr(self, "_already_cancelled", False) and self.task.acks_late and isinstance(exc, JobCancelled)
        ):
            return  # stopped by a shutdown (the asyncio pool): its message goes back to its queue
        if isinstance(exc, JobCancelled):
            # Cancelled while it ran (a solo worker raised it in the job): not a failure. The state Celery stores for
            # a revoke (REVOKED, read as `cancelled`; the cancel stored it already), the revoke signal (counted),
            # and the message acknowledged.
            self._announce_revoked("cancelled", True, None, False)
            return
        if self._lease_lost or (getattr(self, "_already_cancelled", False) and self.task.acks_late):
            # The child died of our terminate (lease lost) or of a cancel at shutdown: not a failure, not a
            # revoke. Nothing stored, nothing dead-lettered: the job is a peer's, or goes back to its queue.
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
