"""Task events only while something consumes them: on when Flower asks, off again when it stops asking.

A task event is one publish from the worker's main process per job state change (received, started,
succeeded...): the main process is what limits a prefork worker on short jobs, so events cost throughput
(docs/deployment.md, "Worker profiles"). Nothing in the pipeline reads them: its metrics come from signals in the
process that runs the job (`pipeline.observability.task_metrics`), job status from the result backend.
Flower does read them, and asks for them itself: with its default `--enable_events`, it broadcasts
`enable_events` to every worker every 5 s (flower/events.py: `Events.on_enable_events`).

So a worker starts with task events off (TASK_EVENTS=false, the default) and turns them on when the
`enable_events` control command arrives (Celery's own handler). `EventsLease` remembers when it last
arrived and turns task events off again once nobody has asked for EVENTS_IDLE_TIMEOUT seconds (Flower
stopped, or was started with `--enable_events=false`). With TASK_EVENTS=true they are on from the start
and stay on (for another consumer of events than Flower, e.g. an exporter that does not ask). A worker
started with both `--without-heartbeat` and `--without-gossip` has no event dispatcher at all unless
TASK_EVENTS is on, so Flower cannot turn its events on. Whether a task event sent now would be published (so
that its fields are worth building) is `pipeline.compat.events.task_events_on`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker.control import Panel

from pipeline.config import get_settings

log = logging.getLogger(__name__)
#: Seconds between two checks of the lease.
CHECK_INTERVAL_S = 5.0
_last_asked: list[float] = []


def _recording(handler: Callable[..., Any]) -> Callable[..., Any]:
    def enable_events(state: Any, *args: Any, **kwargs: Any) -> Any:
        _last_asked[:] = [time.monotonic()]
        return handler(state, *args, **kwargs)

    enable_events.recording = True  # type: ignore[attr-defined]  # marks the wrapper: installed once
    return enable_events


def install() -> None:
    """Record every `enable_events` command this process receives (idempotent)."""
    handler = Panel.data["enable_events"]
    if not getattr(handler, "recording", False):
        Panel.data["enable_events"] = _recording(handler)


def expire(dispatcher: Any, idle_timeout: float, now: float) -> bool:
    """Turn task events off when nobody asked for them in the last `idle_timeout` seconds; True if it did."""
    if dispatcher is None or "task" not in (dispatcher.groups or ()):
        return False
    if _last_asked and now - _last_asked[0] < idle_timeout:
        return False
    if not _last_asked:
        _last_asked[:] = [now]  # turned on by other means than the command: a full lease from now
        return False
    dispatcher.groups.discard("task")
    _last_asked.clear()
    log.info("task events off: nobody asked for them for %.0f s", idle_timeout)
    return True


class EventsLease(bootsteps.StartStopStep):
    """Turns task events off once no `enable_events` arrived for EVENTS_IDLE_TIMEOUT (not with TASK_EVENTS)."""

    requires = ("celery.worker.components:Hub",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(getattr(parent, "use_eventloop", False)) and not get_settings().task_events

    def start(self, parent: Any) -> None:
        timeout = get_settings().events_idle_timeout

        def check() -> None:
            consumer = getattr(parent, "consumer", None)
            expire(getattr(consumer, "event_dispatcher", None), timeout, time.monotonic())

        parent.hub.call_repeatedly(CHECK_INTERVAL_S, check)
