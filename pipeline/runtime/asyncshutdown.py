"""How the asyncio pool (`pipeline.runtime.asyncpool`) shuts down: in the order DESIGN.md asks for.

The jobs in flight finish (`drain`: in the soft shutdown's signal handler, `pipeline.runtime.worker.Worker.
wait_for_soft_shutdown`, or in `on_close` for a warm shutdown, which Celery calls before it stops any step), their
acknowledgements and results land as they end (`acks.land`: Celery schedules each for the event loop's next
iteration, which a stopping worker never runs before its connection closes), and only then do the lease renewal, the
lapse watch, the cancel listener and the connection stop. What is left past WORKER_SOFT_SHUTDOWN_TIMEOUT, and what
waits for a turn, is given back (`give_back`): stopped with `WorkerStopping`, nothing stored or acknowledged, its
message back on its queue when the connection closes (kombu's restore at shutdown), not left for its lease to lapse.
A job sending its effect (`pipeline.once`: an email in the middle of DATA) is not stopped: it finishes and is
acknowledged, or fails, on its own, within SENDING_GRACE_S.
"""

from __future__ import annotations

import collections
import contextlib
import select
import time
from typing import Any

from celery.worker import state

from pipeline import once
from pipeline.delivery import acks
from pipeline.errors import WorkerStopping
from pipeline.pools import aio
from pipeline.runtime.asyncjob import Job, Loop

#: How long a stopped (cancelled) coroutine may take to unwind before it is abandoned and the process recycled.
CANCEL_GRACE_S = 2.0
#: How long a shutdown waits for the jobs sending their effect (an SMTP DATA exchange) past the soft timeout.
SENDING_GRACE_S = 30.0


class Shutdown:
    """The shutdown half of `AsyncPool` (a mixin: the attributes below are the pool's)."""

    jobs: dict[str, list[Job]]
    loop: Loop
    selector: Any
    stopping: bool
    _hub: Any
    _waiting: collections.deque[tuple[Any, ...]]

    def run_once(self) -> None:
        raise NotImplementedError

    def inside(self) -> bool:
        raise NotImplementedError

    def _stop(self, job: Job, reason: BaseException, grace: float | None = None) -> None:
        raise NotImplementedError

    def on_close(self) -> None:
        """First of every shutdown: Celery closes its steps before it stops any (the connection, the lease renewal, the
        lapse watch, the cancel listener). A warm shutdown (`celery control shutdown`, a recycle, SIGTERM without
        REMAP_SIGTERM) lets the jobs in flight finish here, renewed, their acknowledgements landed."""
        if state.should_terminate in (None, False):
            self.drain(None)
        else:  # a cold shutdown: what still runs is given back before the connection closes (not left to its lease)
            self.give_back()

    def on_stop(self) -> None:
        """Warm shutdown: the jobs in flight finish (Celery's soft shutdown already bounded how long), then the loop
        closes its pooled clients."""
        self.drain(None)
        self._close()

    def on_terminate(self) -> None:
        """Cold shutdown: what still runs is stopped; its messages go back when the connection closes."""
        self.give_back()
        self._close()

    def give_back(self) -> bool:
        """From the main thread, outside any job and outside the loop (a shutdown, its soft timeout past): the jobs
        waiting for a turn never start (`drain`), and each one running is stopped with `WorkerStopping` (not a
        cancel: nothing is stored or acknowledged, its message goes back to its queue when the connection closes),
        given CANCEL_GRACE_S to unwind. True when none is left."""
        for job in self.all_jobs():
            if job.task_id not in once.sending:  # one sending its effect finishes (or fails) on its own
                self._stop(job, WorkerStopping(job.task_id))
        if self.drain(CANCEL_GRACE_S):
            return True
        if any(job.task_id in once.sending for job in self.all_jobs()) and self.drain(SENDING_GRACE_S):
            return True
        for job in self.all_jobs():  # past every bound (a server that never answers DATA): stopped after all
            self._stop(job, WorkerStopping(job.task_id))
        return self.drain(CANCEL_GRACE_S)

    def all_jobs(self) -> list[Job]:
        return [job for twins in self.jobs.values() for job in twins]

    def _forget(self, job: Job) -> None:
        twins = self.jobs.get(job.task_id, [])
        if job in twins:
            twins.remove(job)
        if not twins:
            self.jobs.pop(job.task_id, None)

    def _close(self) -> None:
        if self.loop.is_closed() or self.inside():
            return  # never from inside a job: closing the loop there would end every job under it
        if self._hub is not None:
            with contextlib.suppress(Exception):  # the hub may be closed already
                self._hub.remove_reader(self.selector.fileno())
        try:
            self.loop.run_until_complete(aio.close_loop_resources())
        finally:
            self.loop.close()

    def drain(self, timeout: float | None) -> bool:
        """From the main thread, outside any job and outside the loop (a shutdown): go on with the jobs in flight
        until none is left (or `timeout` seconds), landing the acknowledgements and results of those that end as they
        end (`acks.land`: the event loop, which would write them, no longer runs). True when none is left."""
        if not self.jobs:
            return True  # what ended before lands at the delivery step's close (not from a signal's frame)
        if self.inside() or self.loop.is_closed():
            return False  # not from inside a job or an iteration (a signal's handler waits for outside)
        self.stopping = True  # what waits for a turn goes back to its queue with the connection's close
        while self._waiting:
            self._forget(self._waiting.popleft()[0])
        deadline = None if timeout is None else time.monotonic() + timeout
        qoses = {job.qos for job in self.all_jobs() if job.qos is not None}
        while True:
            self.run_once()
            acks.land(self._hub, qoses)
            if not self.jobs:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            pause = 0.05 if left is None else min(0.05, left)
            when = self.loop.next_timer()
            if when is not None:
                pause = min(pause, max(0.0, when - self.loop.time()))
            select.select([self.selector.fileno()], [], [], pause)
