"""One async job in flight in the asyncio pool (`pipeline.runtime.asyncpool`): its greenlet, its limits and how it is
being stopped; and the asyncio loop the pool steps from the worker's own event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from pipeline.delivery import acks
from pipeline.errors import LeaseLost, TransientError, WorkerStopping


class Loop(asyncio.SelectorEventLoop):
    """asyncio's selector loop, stepped by the worker's own event loop (`AsyncPool.run_once`)."""

    def has_ready(self) -> bool:
        """Callbacks are ready to run now (asyncio's own queue, `BaseEventLoop._ready`, 3.11 to 3.14)."""
        return bool(self._ready)  # type: ignore[attr-defined]

    def next_timer(self) -> float | None:
        """When the soonest timer is due, on the loop's clock (`BaseEventLoop._scheduled`, a heap); None: none."""
        scheduled = self._scheduled  # type: ignore[attr-defined]
        return float(scheduled[0].when()) if scheduled else None


class Job:
    """One async job in flight: its greenlet, its limits, and how to stop it."""

    __slots__ = (
        "abandoned",
        "body",
        "call",
        "greenlet",
        "hard",
        "name",
        "qos",
        "reason",
        "soft",
        "started",
        "task_id",
        "timer",
    )

    def __init__(self, name: str, task_id: str, soft: float | None, hard: float | None) -> None:
        self.name = name
        self.task_id = task_id
        self.soft = soft
        self.hard = hard
        self.started = time.monotonic()
        self.greenlet: Any = None
        #: The coroutine it waits for now, as an asyncio task (a plain job: its function's call, as a future).
        self.body: asyncio.Future[Any] | None = None
        #: A plain job's function on its thread (`pipeline.runtime.plainjobs.Call`), once handed to the pool.
        self.call: Any = None
        #: Its next deadline on the loop (a limit, or the end of the time given to unwind).
        self.timer: asyncio.TimerHandle | None = None
        #: The exception the job is being stopped with (a limit or a cancel), once stopped.
        self.reason: BaseException | None = None
        #: Its coroutine ignored its cancellation and was given up.
        self.abandoned = False
        #: The QoS of the delivery the job came in: its result is carried by the call that acknowledges it.
        self.qos: Any = acks.current_qos()

    def first_deadline(self) -> float | None:
        """When its first limit is due (a per-call hard limit may come before the worker's soft one)."""
        due = [self.started + limit for limit in (self.soft, self.hard) if limit is not None]
        return min(due) if due else None

    def outcome(self, ended: asyncio.Future[Any] | None) -> Any:
        """What its trace goes on with: the coroutine's result, or the exception to raise in it."""
        error = None if ended is None or ended.cancelled() else ended.exception()
        if self.reason is not None and type(error) is type(self.reason):  # a stop raised in a plain job's thread
            raise self.reason.with_traceback(error.__traceback__)
        if ended is None or ended.cancelled() or isinstance(error, asyncio.CancelledError):
            if self.reason is None:  # not a stop of this pool's: a library's cancellation let out of the job
                raise TransientError("the job's coroutine was cancelled by none of its stops (asyncio.CancelledError)")
            if self.abandoned and isinstance(self.reason, SoftTimeLimitExceeded) and self.hard is not None:
                raise TimeLimitExceeded(self.hard)  # it ran on to its hard limit
            raise self.reason
        return ended.result()


def overrides(reason: BaseException, current: BaseException) -> bool:
    """A job being stopped already is stopped again, no later than before, for a lost lease (whatever stopped it: it
    must not run on past the lapse, to a hard limit) and for a shutdown's give back after a time limit."""
    if isinstance(reason, LeaseLost):
        return not isinstance(current, LeaseLost)
    return isinstance(reason, WorkerStopping) and isinstance(current, (SoftTimeLimitExceeded, TimeLimitExceeded))
