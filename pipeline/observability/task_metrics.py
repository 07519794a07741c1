"""Task lifecycle → metric observations (called by the handlers in `pipeline.runtime.signals`).

Runtime is measured between `task_prerun` and `task_postrun`, which run in the same process (the pool
child, or the worker itself for thread/solo pools). Queue wait is `start - max(published, eta)`: the
publish-time header `pipeline_published_at`, never the countdown/ETA the producer asked for, clamped
at zero (clocks of producer and worker may disagree slightly).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from celery import states

from pipeline.constants import HEADER_PUBLISHED_AT
from pipeline.observability import metrics
from pipeline.task import request_header

#: task id → (when the attempt started, its queue), from `task_prerun` to `task_postrun`.
_started: dict[str, tuple[float, str]] = {}


def queue_of(task: Any, request: Any = None) -> str:
    """The queue a task's message came from: its routing key, else the queue the router picks."""
    request = request if request is not None else getattr(task, "request", None)
    info = getattr(request, "delivery_info", None) or {}
    if info.get("routing_key"):
        return str(info["routing_key"])
    app = getattr(task, "app", None)
    if app is not None and getattr(task, "name", None):
        return str(app.amqp.router.route({}, task.name)["queue"].name)
    return "unknown"


def _published_at(request: Any) -> float | None:
    value = request_header(request, HEADER_PUBLISHED_AT)
    return float(value) if isinstance(value, int | float) else None


def _eta(request: Any) -> float | None:
    eta = getattr(request, "eta", None)
    if isinstance(eta, datetime):
        return eta.timestamp()
    if isinstance(eta, str):
        try:
            return datetime.fromisoformat(eta).timestamp()
        except ValueError:
            return None
    return None


def queue_wait(request: Any, now: float) -> float | None:
    """Seconds the attempt waited to start, excluding a requested delay; None without the header."""
    published = _published_at(request)
    if published is None:
        return None
    ready = max(published, _eta(request) or published)
    return max(0.0, now - ready)


def started(task: Any, task_id: str) -> None:
    request = task.request
    queue = queue_of(task, request)
    _started[task_id] = (time.perf_counter(), queue)  # the queue again for `finished`: looked up once per job
    wait = queue_wait(request, time.time())
    if wait is not None:
        metrics.child(metrics.task_queue_wait, task.name, queue).observe(wait)


def finished(task: Any, task_id: str, state: str | None = None) -> None:
    """The attempt's runtime and, when it succeeded, its outcome (`task_postrun` carries the final state, so the
    success needs no handler of its own); failures, retries and revokes have their own signals."""
    began = _started.pop(task_id, None)
    if began is None:
        queue = queue_of(task)
    else:
        start, queue = began
        metrics.child(metrics.task_runtime, task.name, queue).observe(time.perf_counter() - start)
    if state == states.SUCCESS:
        outcome(task.name, queue, "succeeded")


def outcome(task_name: str, queue: str, result: str) -> None:
    metrics.child(metrics.tasks, task_name, queue, result).inc()


def task_outcome(task: Any, result: str, request: Any = None) -> None:
    outcome(str(task.name), queue_of(task, request), result)


def message_outcome(message: Any, result: str, registered: set[str]) -> None:
    """Outcome of a message the worker refused before it became a task (rejected content)."""
    headers = getattr(message, "headers", None) or {}
    name = headers.get("task")
    info = getattr(message, "delivery_info", None) or {}
    task = name if name in registered else metrics.UNREGISTERED
    outcome(str(task), str(info.get("routing_key") or "unknown"), result)
