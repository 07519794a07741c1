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

The same handler raises what another thread asks for (`interrupt`): a cancel of the running job
(`pipeline.runtime.cancels`) reaches the job like a time limit, blocking calls included.
"""

from __future__ import annotations

import signal
import threading
from types import CodeType, FrameType

from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from pipeline.task import GUARDS, PipelineTask


def limits(task: PipelineTask) -> tuple[float | None, float | None]:
    """(soft, hard) seconds for the running job; None where there is no limit."""
    stamped = task.request.timelimit or (None, None)  # (hard, soft) from the message
    conf = task.app.conf
    hard = stamped[0] or task.time_limit or conf.task_time_limit
    soft = stamped[1] or task.soft_time_limit or conf.task_soft_time_limit
    return (float(soft) if soft else None), (float(hard) if hard else None)


class AlarmLimits:
    """The guard (`pipeline.task.Guard`): one SIGALRM handler for the process, the timer armed around each job.

    The handler is installed once (`enable`, from the main thread: only there can Python set one); between jobs
    the timer is off, and a stray SIGALRM finds nothing armed and does nothing. A job started on another thread
    (no signal reaches it there), or in a process where the handler could not be installed, runs without the
    timer: arming it without the handler would let SIGALRM's default action kill the process.
    """

    def __init__(self) -> None:
        #: (seconds from the job's start, exception) still to raise, soonest first.
        self._stages: list[tuple[float, type[Exception]]] = []
        self._armed = False
        #: The thread the handler runs on (the main thread), once installed.
        self._thread: int | None = None
        #: An exception another thread asked to raise in the running job (`interrupt`), raised by the handler.
        self._interrupt: type[Exception] | None = None
        #: Raise it only while this function runs (a plain task's: `interrupt`'s `within`).
        self._within: CodeType | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, self._on_alarm)
            self._thread = threading.get_ident()

    def start(self, task: PipelineTask) -> None:
        if threading.get_ident() != self._thread:
            return
        soft, hard = limits(task)
        stages: list[tuple[float, type[Exception]]] = []
        if soft:
            stages.append((soft, SoftTimeLimitExceeded))
        if hard:
            stages.append((hard, TimeLimitExceeded))
        if stages:
            self._stages, self._armed = stages, True
            signal.setitimer(signal.ITIMER_REAL, stages[0][0])

    def stop(self) -> None:
        if self._armed:
            self._stages, self._armed = [], False
            signal.setitimer(signal.ITIMER_REAL, 0)

    def installed_on(self, thread: int) -> bool:
        """Whether the handler runs on `thread` (the main thread, once `install`ed there)."""
        return self._thread is not None and self._thread == thread

    def interrupt(self, exc: type[Exception], within: CodeType | None = None) -> None:
        """Raise `exc` in the job running on the main thread, from any thread: the handler raises it, as it raises a
        time limit, and a blocking call the job is in is interrupted too (a cancel: `pipeline.runtime.cancels`).
        With `within`, only if that function is still running when the signal lands (else it is dropped)."""
        if self._thread is None:
            raise RuntimeError("the SIGALRM handler is not installed")
        self._interrupt, self._within = exc, within
        signal.pthread_kill(self._thread, signal.SIGALRM)

    def clear_interrupt(self) -> None:
        """Forget an `interrupt` the handler has not raised yet (the job ended first)."""
        self._interrupt = self._within = None

    def _on_alarm(self, _signum: int, frame: FrameType | None) -> None:
        interrupt, self._interrupt = self._interrupt, None
        within, self._within = self._within, None
        if interrupt is not None:
            if within is None or _running(frame, within):
                raise interrupt()
            return  # the function it was meant for has returned: what runs now is the tracer's
        if not self._stages:
            return  # nothing armed: a stray signal, or the job ended as the timer fired
        limit, exc = self._stages.pop(0)
        if self._stages:  # the hard limit, counted from the start of the job
            signal.setitimer(signal.ITIMER_REAL, max(0.001, self._stages[0][0] - limit))
        raise exc(limit)


def _running(frame: FrameType | None, code: CodeType) -> bool:
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


alarm_limits = AlarmLimits()


def enable() -> None:
    """Apply time limits around every task of this process (idempotent): for a solo worker, from its main thread."""
    if alarm_limits not in GUARDS:
        alarm_limits.install()
        GUARDS.append(alarm_limits)
