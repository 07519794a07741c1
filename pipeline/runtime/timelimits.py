"""Soft and hard time limits for the solo pool, which Celery does not enforce there.

Celery enforces time limits in the prefork pool (the parent kills a child past the hard limit, SIGUSR1
raises `SoftTimeLimitExceeded` in it) and in gevent/eventlet; the solo and threads pools ignore them. A
solo worker runs each job in its main thread, where a SIGALRM handler runs too, so the same two limits
hold with one interval timer around the task's function (`pipeline.task.GUARDS`):

* at the soft limit, `SoftTimeLimitExceeded` is raised in the task, as in prefork: it may clean up;
* at the hard limit, `TimeLimitExceeded` is raised, in case the task caught the first one and went on.

A blocking call (socket read, sleep, subprocess wait) is interrupted by the signal, so a hung SMTP
conversation or webhook delivery ends at the limit whatever its socket timeouts. Either exception fails
the job like any other error: dead-lettered (`pipeline.dlq.capture`) and counted. What the timer cannot
stop is a job that swallows both exceptions, or C code that does not return to Python; the prefork pool's
kill is the only bound for those (the `long` profile keeps prefork).

The limits are the job's own (`timelimit` stamped by the producer), else the task's, else
TASK_SOFT_TIME_LIMIT/TASK_TIME_LIMIT, as Celery resolves them for prefork.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from pipeline.task import GUARDS, PipelineTask


def limits(task: PipelineTask) -> tuple[float | None, float | None]:
    """(soft, hard) seconds for the running job; None where there is no limit."""
    stamped = task.request.timelimit or (None, None)  # (hard, soft) from the message
    conf = task.app.conf
    hard = stamped[0] or task.time_limit or conf.task_time_limit
    soft = stamped[1] or task.soft_time_limit or conf.task_soft_time_limit
    return (float(soft) if soft else None), (float(hard) if hard else None)


@contextlib.contextmanager
def alarm_limits(task: PipelineTask) -> Iterator[None]:
    """Raise the time-limit exceptions in this (main) thread while the task's function runs."""
    soft, hard = limits(task)
    if not (soft or hard) or threading.current_thread() is not threading.main_thread():
        yield
        return
    stages = [s for s in ((soft, SoftTimeLimitExceeded), (hard, TimeLimitExceeded)) if s[0]]

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        limit, exc = stages.pop(0)
        if stages:  # the hard limit, counted from the start of the job
            signal.setitimer(signal.ITIMER_REAL, max(0.001, stages[0][0] - limit))  # type: ignore[operator]
        raise exc(limit)

    previous: Any = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, stages[0][0])  # type: ignore[arg-type]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def enable() -> None:
    """Apply time limits around every task of this process (idempotent): for a solo worker."""
    if alarm_limits not in GUARDS:
        GUARDS.append(alarm_limits)
