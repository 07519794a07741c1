"""Celery signal handlers, wired in one place: `install()` connects them, `uninstall()` disconnects them.

Each handler only translates a signal's arguments into a call on the module that owns the concern
(the dead-letter queue, message headers). Celery swallows exceptions raised in handlers, so every
handler runs under `guarded`, which logs the error and counts it in
`pipeline_signal_handler_errors_total`.

The failure handler runs in the pool child for exceptions raised by a task, and in the worker's main
process for a killed child or a hard time limit; both paths publish through the app's producer pool.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import current_app, signals
from celery.utils.dispatch import Signal

from pipeline.constants import HEADER_PUBLISHED_AT
from pipeline.dlq import capture
from pipeline.flows import reconcile
from pipeline.observability import endpoint, logs, metrics, multiproc, sentry, task_metrics
from pipeline.producer.hooks import publish_safe
from pipeline.queues import keys as layout
from pipeline.runtime import cancels, lapses
from pipeline.scheduling import delayed

log = logging.getLogger(__name__)
_connected: list[tuple[Signal, Callable[..., Any], str]] = []


def guarded(handler: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            handler(*args, **kwargs)
        except Exception:
            metrics.signal_handler_errors.labels(handler=handler.__name__).inc()
            log.exception("signal handler %s failed", handler.__name__)

    return wrapper


@guarded
@publish_safe  # templated messages carry the stamp themselves (pipeline.producer)
def on_before_task_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp the publish time (for queue-wait figures) unless the producer already did."""
    if headers is not None:
        headers.setdefault(HEADER_PUBLISHED_AT, time.time())


@guarded
def on_task_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    einfo: Any = None,
    **_: Any,
) -> None:
    capture.from_failure(sender, task_id, exception, args, kwargs, einfo)


@guarded
def on_task_rejected(message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    capture.from_message("rejected", message, exc)


@guarded
def on_task_unknown(
    message: Any = None, exc: BaseException | None = None, name: str | None = None, id: str | None = None, **_: Any
) -> None:
    capture.from_message("unknown_task", message, exc, task_name=name, task_id=id)


@guarded
def on_worker_ready(**_: Any) -> None:
    capture.on_worker_ready()


#: The flows' reconciler as a chore of the releaser's loop.
RECONCILING = ("queueing flows' cut-short hand-offs", reconcile.reconcile)


@guarded
def start_delayed_releaser(**_: Any) -> None:
    """Worker main process and beat: release parked delayed jobs when due (see `pipeline.publish`); on a Redis
    Cluster the same loop queues flows' steps whose hand-off was cut short (`pipeline.flows.reconcile`)."""
    if layout.clustered() and RECONCILING not in delayed.CHORES:
        delayed.CHORES.append(RECONCILING)
    delayed.start_releaser()


@guarded
def stop_delayed_releaser(**_: Any) -> None:
    delayed.stop_releaser()


@guarded
def on_task_prerun(sender: Any = None, task_id: str = "", **_: Any) -> None:
    cancels.plain_started(sender)  # one handler for both: each receiver costs Celery's dispatch more than its work
    task_metrics.started(sender, task_id)


@guarded
def on_task_postrun(sender: Any = None, task_id: str = "", state: str | None = None, **_: Any) -> None:
    cancels.plain_ended(sender)
    task_metrics.finished(sender, task_id, state)  # a SUCCESS is counted here: one handler less per job


@guarded
def on_task_failure_metrics(sender: Any = None, **_: Any) -> None:
    task_metrics.task_outcome(sender, "failed")


@guarded
def on_task_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    task_metrics.task_outcome(sender, "retried", request)


@guarded
def on_task_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    task_metrics.task_outcome(sender, "cancelled", request)  # a cancel is stored as Celery's REVOKED


@guarded
def on_task_rejected_metrics(sender: Any = None, message: Any = None, **_: Any) -> None:
    task_metrics.message_outcome(message, "rejected", set(getattr(sender, "app", current_app).tasks))


@guarded
def on_worker_ready_metrics(sender: Any = None, **_: Any) -> None:
    endpoint.serve_worker_metrics(sender)


@guarded
def on_worker_process_shutdown(pid: int | None = None, **_: Any) -> None:
    endpoint.mark_dead(pid if pid is not None else os.getpid())


@guarded
def on_setup_logging(loglevel: Any = None, logfile: str | None = None, **_: Any) -> None:
    """Connected, so Celery leaves logging to us: structured lines with the task bound (worker, children, beat)."""
    logs.configure_logging(loglevel or None, logfile or None)


@guarded
def on_celeryd_init_metrics(sender: Any = None, **_: Any) -> None:
    """`celery worker`'s main process, before the pool forks: a multiprocess metrics directory if needed."""
    multiproc.prepare(str(sender or "worker"))


@guarded
def on_worker_process_init(**_: Any) -> None:
    """A prefork child: the signal that raises `LeaseLost` in its job (`pipeline.runtime.lapses`)."""
    lapses.install_in_child()


@guarded
def on_celeryd_init(**_: Any) -> None:
    sentry.init_sentry("worker")


@guarded
def on_beat_init(**_: Any) -> None:
    sentry.init_sentry("beat")


_HANDLERS: list[tuple[Signal, Callable[..., None]]] = [
    (signals.setup_logging, on_setup_logging),
    (signals.celeryd_init, on_celeryd_init_metrics),
    (signals.celeryd_init, on_celeryd_init),
    (signals.beat_init, on_beat_init),
    (signals.task_prerun, on_task_prerun),
    (signals.task_postrun, on_task_postrun),
    (signals.task_failure, on_task_failure_metrics),
    (signals.task_retry, on_task_retry),
    (signals.task_revoked, on_task_revoked),
    (signals.task_rejected, on_task_rejected_metrics),
    (signals.worker_ready, on_worker_ready_metrics),
    (signals.worker_process_init, on_worker_process_init),
    (signals.worker_process_shutdown, on_worker_process_shutdown),
    (signals.before_task_publish, on_before_task_publish),
    (signals.task_failure, on_task_failure),
    (signals.task_rejected, on_task_rejected),
    (signals.task_unknown, on_task_unknown),
    (signals.worker_ready, on_worker_ready),
    (signals.worker_ready, start_delayed_releaser),
    (signals.beat_init, start_delayed_releaser),
    (signals.worker_shutdown, stop_delayed_releaser),
]


def install() -> None:
    """Connect every handler once (idempotent)."""
    if _connected:
        return
    for signal, handler in _HANDLERS:
        uid = f"pipeline.{handler.__name__}"
        signal.connect(handler, weak=False, dispatch_uid=uid)
        _connected.append((signal, handler, uid))


def uninstall() -> None:
    for signal, handler, uid in _connected:
        signal.disconnect(handler, dispatch_uid=uid)
    _connected.clear()
