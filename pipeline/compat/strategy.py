"""How a solo worker starts a job it received: Celery's own steps in a row, without the pool's indirections.

Celery hands each message to its task's strategy (`Task.Strategy`, `celery/worker/strategy.py: default`). The
strategy builds the request, logs and signals its arrival, and passes it to the worker
(`WorkController._process_task`), which asks the request to run itself through the pool
(`Request.execute_using_pool` → `BasePool.apply_async` → the solo pool's `apply_target` → `fast_trace_task` →
the task's tracer) with the request's `on_accepted` and `on_success` as callbacks. In a solo pool every one of
those calls runs in this thread, one inside the other, once per job: a few microseconds each, on a path where a
short job's whole cost is the worker's own bookkeeping (docs/deployment.md, "Worker profiles").

`default`, the strategy of every pipeline task (`PipelineTask.Strategy`), is Celery's, plus this: in a solo worker
whose worker hands requests straight to the pool, a message Celery would also hand straight on (protocol 2, no ETA,
no rate-limit bucket for its task) makes the same calls in a row: the request (the task's own class), the received
log line and signal, `task_reserved`, then the request's revoke check, `on_accepted`, the tracer Celery would call
(`apply_target`, the solo pool's own function, runs it) and `on_success`. The `task-received` event is built only
when the worker sends task events (Celery builds its fields and the dispatcher drops them while the `task` group is
off: `pipeline.compat.events`). Anything else (an ETA or countdown, a rate limit, a protocol-1 message, another
pool, a worker with an autoscaler) takes Celery's own handler, unchanged, and so does every message when the
installed Celery is not a version this was verified on (`pipeline.compat.versions`: checked once, when the first
task's strategy is built).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import signals
from celery.app import trace as celery_trace
from celery.concurrency.base import apply_target
from celery.utils.imports import symbol_by_name
from celery.worker import strategy as celery_strategy
from celery.worker.state import task_reserved
from celery.worker.worker import WorkController

from pipeline import compat
from pipeline.compat.events import task_events_on
from pipeline.pools import is_solo

#: `Task.Strategy` of every pipeline task.
STRATEGY = "pipeline.compat.strategy:default"


def _hands_straight_to_the_pool(consumer: Any) -> bool:
    handle = getattr(consumer, "on_task_request", None)
    process_task = WorkController._process_task  # type: ignore[attr-defined]  # untyped in celery-types
    return getattr(handle, "__func__", None) is process_task and is_solo(consumer.pool)


def default(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's strategy for `task`; in a solo worker, with the direct path in front of it (see the module doc)."""
    celery_handler = celery_strategy.default(task, app, consumer, **kwargs)
    if not _hands_straight_to_the_pool(consumer) or not compat.enabled(__name__) or getattr(task, "is_async", False):
        return celery_handler

    hostname = consumer.hostname
    connection_errors = consumer.connection_errors
    eventer = consumer.event_dispatcher
    buckets = consumer.task_buckets
    rate_limits_enabled = not consumer.disable_rate_limits
    revoked_tasks = consumer.controller.state.revoked
    pool = consumer.pool
    events = bool(eventer and eventer.enabled)  # as Celery's strategy: no task events unless on when it was built
    does_info = celery_strategy.logger.isEnabledFor(logging.INFO)
    info = celery_strategy.logger.info
    received = signals.task_received
    Req = celery_strategy.create_request_cls(symbol_by_name(task.Request), task, pool, hostname, eventer, app=app)  # type: ignore[attr-defined]  # untyped in celery-types
    trace = celery_trace.fast_trace_task if app.use_fast_trace_task else celery_trace.trace_task_ret
    pid = os.getpid()
    utc = app.uses_utc_timezone()  # `app.timezone` is a cached property: fixed once read

    def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **options: Any) -> Any:
        headers = message.headers
        if (
            body is not None
            or "args" in message.payload
            or headers.get("eta")
            or (rate_limits_enabled and buckets[task.name] is not None)
            or getattr(pool, "_does_debug", False)  # Celery's pool logs each job it applies at DEBUG
        ):
            return celery_handler(message, body, ack, reject, callbacks, **options)
        req = Req(
            message,
            on_ack=ack,
            on_reject=reject,
            app=app,
            hostname=hostname,
            eventer=eventer,
            task=task,
            connection_errors=connection_errors,
            body=message.body,
            headers=headers,
            decoded=False,
            utc=utc,
        )
        if does_info:
            context = {"id": req.id, "name": req.name, "args": req.argsrepr, "kwargs": req.kwargsrepr, "eta": req.eta}
            info(celery_trace.LOG_RECEIVED, context, extra={"data": context})
        if (req.expires or req.id in revoked_tasks) and req.revoked():
            return None
        received.send(sender=consumer, request=req)
        if events and task.send_events and task_events_on(eventer):
            eventer.send(
                "task-received",
                uuid=req.id,
                name=req.name,
                args=req.argsrepr,
                kwargs=req.kwargsrepr,
                root_id=req.root_id,
                parent_id=req.parent_id,
                retries=req.request_dict.get("retries", 0),
                eta=None,
                expires=req.expires and req.expires.isoformat(),
            )
        task_reserved(req)
        if callbacks:
            for callback in callbacks:
                callback(req)
        # WorkController._process_task → Request.execute_using_pool (a revoked request is dropped there) →
        # BasePool.apply_async → apply_target
        if req.revoked():
            return None
        args = (req.type, req.id, req.request_dict, req.body, req.content_type, req.content_encoding)
        apply_target(trace, args, None, req.on_success, req.on_accepted, pid, monotonic=time.monotonic)
        return None

    return task_message_handler
