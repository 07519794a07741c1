"""The asyncio pool: one worker process keeps WORKER_CONCURRENCY jobs in flight (`-P custom`, what `pipeline worker`
runs for the I/O queues).

Celery's tracer is synchronous. Every job's trace (signals, the result, the acknowledgement) runs in the worker's
main thread, as in the solo pool, so the solo profile's economies hold: the result carried by the acknowledging
call, acknowledgements written together on the event loop's tick, one decode. Where a job's function runs differs:

* an `async def` task (`PipelineTask.is_async`: `webhooks.deliver`, `email.send`) is traced in a greenlet
  (`pipeline.pools.aio.JobGreenlet`). When its function returns its coroutine, the greenlet switches back to the
  worker, which hands the coroutine to the process's asyncio loop and goes on with other jobs. That loop has no
  thread of its own: the worker's event loop (kombu's hub) steps it (`run_once`) when its selector has events, at its
  next timer and after a job handed it a coroutine. Once a coroutine has ended, outside the loop's iteration, the
  worker switches into its greenlet with the result or the exception, and the trace goes on. Celery's request
  context is per greenlet (`celery.utils.threads` keys it so), so each job sees its own `task.request`;
* a plain (sync) task is traced the same way, in a `PlainGreenlet` (`pipeline.runtime.plainjobs`); its function
  runs on one of WORKER_PLAIN_THREADS daemon threads (more wait for a thread, in order), and the pool awaits the
  call's future on its loop as it awaits a coroutine. So a plain job that sleeps holds up no other job, and the
  worker answers control commands meanwhile. A stop is raised in its thread as an asynchronous exception (at its
  next Python instruction: a blocking call in C is not interrupted). CPU-bound sync work belongs on prefork: the
  threads share one interpreter lock with the main thread.

Backpressure: Celery's prefetch is the pool's limit times the multiplier, and the worker sets the multiplier to 1
for this pool (`pipeline.runtime.worker`), so it never holds more unacknowledged jobs than it may run at once. With
a multiplier given explicitly (WORKER_PREFETCH_MULTIPLIER), the jobs received beyond the limit wait in the pool,
in order, for a running one to end: never more than the limit run at once.

Per job, on the loop (the task's limits, the settings', or the call's: `apply_async(soft_time_limit=, time_limit=)`;
a plain job's count from its thread's start, not from its wait for one; the solo pool's SIGALRM timer,
`pipeline.runtime.timelimits`, is not used here): the soft time limit cancels an async job's coroutine and
`SoftTimeLimitExceeded` is raised in the job (it fails, retried or dead-lettered as any error); in a plain job it is
raised in its thread, where the job may catch it and go on, as on prefork. A hard limit without a soft one before it
stops the job with `TimeLimitExceeded` the same way. A coroutine (or a thread) that ignores its stop until the hard
limit (or CANCEL_GRACE_S after a cancel or a hard limit) is abandoned there, the job ends with `TimeLimitExceeded`
(or its cancel), is reported (`pipeline_jobs_abandoned_total`) and the process is recycled: a warm shutdown, after
which `pipeline worker` starts it again (a plain job's threads are daemons: they do not keep it from exiting). A
cancel of a running job (`pipeline.runtime.cancels`) or a lease a peer took (fencing) raises `JobCancelled` in it
through `stop_job`; a lease that cannot be renewed in time (`pipeline.runtime.lapses`) raises `LeaseLost`, and a job
that ignores it is given up when the lease lapses.

Shutdown: `pipeline.runtime.asyncshutdown` (the jobs in flight finish and their acknowledgements land before any
step stops; what cannot finish is given back). While jobs are in flight a shutdown signal is handled at
the pool's safe point, the end of `run_once` (`pipeline.runtime.asyncsignals`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import selectors
import time
from typing import Any

from celery.concurrency.base import BasePool, apply_target
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.worker import state
from greenlet import getcurrent  # type: ignore[import-untyped]  # no stubs are published

from pipeline import once
from pipeline.config import get_settings
from pipeline.delivery import acks
from pipeline.errors import JobCancelled, LeaseLost
from pipeline.observability import metrics
from pipeline.pools import aio
from pipeline.runtime import plainjobs
from pipeline.runtime.asyncjob import Job, Loop, overrides
from pipeline.runtime.asyncshutdown import CANCEL_GRACE_S, Shutdown
from pipeline.runtime.asyncsignals import Deferred

log = logging.getLogger(__name__)

#: Rounds of the asyncio loop one wake-up runs at most before the worker's own events get their turn.
MAX_ROUNDS = 64
#: What `pipeline worker` passes (`-P custom` with CELERY_CUSTOM_WORKER_POOL naming this class).
POOL = "pipeline.runtime.asyncpool:AsyncPool"


class AsyncPool(Shutdown, BasePool):
    """See the module doc."""

    body_can_be_buffer = True
    signal_safe = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.selector = selectors.DefaultSelector()
        self.loop = Loop(self.selector)
        #: The async jobs here (running or waiting for a turn), by task id: two deliveries of one id may both run.
        self.jobs: dict[str, list[Job]] = {}
        #: Coroutines that ended, (job, task), for their greenlets to go on outside the loop's iteration.
        self._ended: collections.deque[tuple[Job, asyncio.Task[Any] | None]] = collections.deque()
        #: Async jobs received beyond the limit (a prefetch multiplier above 1), in order, and how many run now.
        self._waiting: collections.deque[tuple[Any, ...]] = collections.deque()
        self.running = 0
        self._hub: Any = None
        self._timer: Any = None
        self._timer_at = 0.0
        self._pid = os.getpid()
        self.recycling = False
        self.stopping = False  # a shutdown gives back what waits for a turn: nothing more starts
        #: Shutdown signals that landed inside a job or the loop's iteration, run once outside (`Worker` installs it).
        self.signals = Deferred(lambda: bool(self.jobs), self._nudge)
        self._busy = 0  # in run_once or on_apply (see `inside`)
        self._ends = 0  # jobs ended so far (`run_once` nudges the hub after it ended any)
        #: Where plain jobs' functions run (WORKER_PLAIN_THREADS at most at once), known at start.
        self.threads: plainjobs.Threads | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def on_start(self) -> None:
        """Before the consumer builds the tasks' tracers: plain tasks hand their function to the pool's threads."""
        self._pid = os.getpid()
        self.threads = plainjobs.Threads(get_settings().worker_plain_threads)
        if self.app is not None:
            plainjobs.install(self.app)

    def register_with_event_loop(self, loop: Any) -> None:
        """The worker's event loop (kombu's hub) runs the asyncio loop: whenever the asyncio loop's selector has
        events (its own file descriptor is readable), at its next timer, and after a job hands it a coroutine."""
        self._hub = loop
        loop.add_reader(self.selector.fileno(), self.run_once)

    @property
    def num_processes(self) -> int:
        return int(self.limit or 0)

    @property
    def in_flight(self) -> int:
        return sum(len(twins) for twins in self.jobs.values())

    # -- running the asyncio loop from the worker's -----------------------------------------------------------

    def run_once(self) -> None:
        """Run what the asyncio loop has to do now (its ready callbacks, its I/O, timers due), then the traces of the
        jobs whose coroutine ended, until nothing is left to do now; arm the hub for the loop's next timer."""
        loop = self.loop
        if loop.is_running() or loop.is_closed():
            return
        self._busy += 1
        ends = self._ends
        try:
            for _ in range(MAX_ROUNDS):
                loop.call_soon(loop.stop)
                loop.run_forever()  # one iteration: stop() was called first (asyncio's documented behaviour)
                self._resume_ended()
                if not loop.has_ready():
                    break
            else:
                self._wake()  # more to do: after the worker's other events
            self._arm_timer()
            if self._ends != ends:
                # Celery acknowledges an ended job on the hub's next iteration (`call_soon`), and only then may the
                # next job be fetched; called from the hub's ready queue (not from its poll), that iteration would
                # poll until its next timer first (up to a quarter second): a write to the loop's self-pipe wakes it.
                self._nudge()
        finally:
            self._busy -= 1
        if self.signals.pending:
            self.signals.deliver()

    def inside(self) -> bool:
        """The main thread is in the pool's own steps now (a job's greenlet, the loop's iteration, the bookkeeping
        between them): a shutdown's drain must not run from here."""
        return bool(self._busy or getcurrent().parent is not None or self.loop.is_running())

    def _nudge(self) -> None:
        """Have the hub call `run_once` soon (from a signal handler: a write to the loop's self-pipe)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_nothing)

    def _arm_timer(self) -> None:
        when = self.loop.next_timer()
        hub = self._hub
        if when is None or hub is None:
            return
        if self._timer is not None and self._timer_at <= when:
            return  # an earlier (or the same) wake-up is armed
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = hub.call_later(max(0.0, when - self.loop.time()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.run_once()

    def _wake(self) -> None:
        if self._hub is not None:
            self._hub.call_soon(self.run_once)

    # -- applying a job --------------------------------------------------------------------------------------

    def on_apply(
        self,
        target: Any,
        args: Any = None,
        kwargs: Any = None,
        callback: Any = None,
        accept_callback: Any = None,
        timeout: float | None = None,
        soft_timeout: float | None = None,
        **_: Any,
    ) -> None:
        self._busy += 1
        try:
            self._apply(target, args, kwargs, callback, accept_callback, timeout, soft_timeout)
        finally:
            self._busy -= 1

    def _apply(self, target: Any, *trace: Any) -> None:
        args, kwargs, callback, accept_callback, timeout, soft_timeout = trace
        hard = timeout or self.options.get("timeout") or None
        soft = soft_timeout or self.options.get("soft_timeout") or None
        job = Job(str(args[0]), str(args[1]), soft, hard)
        self.jobs.setdefault(job.task_id, []).append(job)
        task = self.app.tasks.get(job.name) if self.app is not None else None
        plain = not getattr(task, "is_async", False)  # its function runs on a thread (`plainjobs`)
        job.greenlet = (plainjobs.PlainGreenlet if plain else aio.JobGreenlet)(self._trace)
        start = (job, target, args, kwargs, callback, accept_callback)
        if self.running >= int(self.limit or 1):  # a prefetch above the limit (a multiplier given): it waits its turn
            self._waiting.append(start)
            return
        self._start(*start)

    def _start(self, job: Job, *trace: Any) -> None:
        self.running += 1
        job.started = time.monotonic()  # its limits count from here, not from its wait for a turn
        self._after(job, job.greenlet.switch(job, *trace))

    def _next(self) -> None:
        """A slot is free: start the job that waited longest, unless a shutdown gives them back. One whose delivery
        was lost or revoked while it waited (Celery's checks ran when it was received) is dropped unstarted, as the
        worker drops such a request (`Request.revoked`)."""
        while self._waiting and not self.stopping:
            start = self._waiting.popleft()
            request = state.requests.get(start[0].task_id)
            if request is not None and request.revoked():
                self._forget(start[0])
                continue
            self._start(*start)
            return

    def _trace(self, job: Job, target: Any, args: Any, kwargs: Any, callback: Any, accept: Any) -> None:
        try:
            apply_target(target, args, kwargs, callback, accept, pid=self._pid)
        except BaseException:  # the tracer handled the job's own errors; this is the pool's bookkeeping failing
            log.exception("job %s: its trace raised", job.task_id)

    def _after(self, job: Job, awaited: Any) -> None:
        """`job`'s trace switched back: it ended, or it waits for `awaited`, its coroutine (handed to the loop)."""
        if job.greenlet.dead:
            self._ends += 1
            if job.timer is not None:
                job.timer.cancel()
            self._forget(job)
            once.sending.discard(job.task_id)
            self.running -= 1
            self._next()
            return
        if isinstance(job.greenlet, plainjobs.PlainGreenlet):
            self._hand(job, awaited)
        elif job.reason is not None:  # stopped (a limit, a cancel) while outside its coroutine: raised at once
            awaited.close()
            self._ended.append((job, None))
        else:
            body = job.body = self.loop.create_task(awaited)
            body.add_done_callback(lambda ended: self._ended.append((job, ended)))
            if job.timer is None:
                self._arm(job, job.first_deadline())
        if not self.loop.is_running():
            self._wake()

    def _hand(self, job: Job, fn: Any) -> None:
        """A plain job's function, `fn`, to its thread; its limits are armed when the thread starts it."""
        if job.reason is not None:  # stopped (a cancel) before its function started: raised at once
            self._ended.append((job, None))
            return
        call = job.call = plainjobs.Call(fn, self.loop)
        call.on_begin = lambda started: self._began(job, started)
        body = job.body = call.future
        body.add_done_callback(lambda ended: self._ended.append((job, ended)))
        if self.threads is None:  # a pool used without `on_start`
            self.threads = plainjobs.Threads(get_settings().worker_plain_threads)
        if self.threads.submit(call):  # a thread starts it now
            self._began(job, time.monotonic())

    def _began(self, job: Job, started: float) -> None:
        job.started = started  # its limits count from here, not from its wait for a thread
        if job.timer is None and job.reason is None and not job.greenlet.dead:
            self._arm(job, job.first_deadline())

    def _resume_ended(self) -> None:
        """Outside the loop's iteration: switch into the greenlet of each job whose coroutine has ended (or that was
        given up), with its outcome."""
        while self._ended:
            job, ended = self._ended.popleft()
            if ended is not job.body:  # the coroutine of a job given up before it ended: the job went on without it
                continue
            job.body = None
            with acks.delivering(job.qos) if job.qos is not None else contextlib.nullcontext():
                try:
                    result = job.outcome(ended)
                except BaseException as exc:  # noqa: BLE001  # the job's own exception, raised in its trace
                    awaited = job.greenlet.throw(exc)
                else:
                    awaited = job.greenlet.switch(result)
            self._after(job, awaited)

    # -- a job's deadlines, on the loop ----------------------------------------------------------------------

    def _arm(self, job: Job, at: float | None) -> None:
        if job.timer is not None:
            job.timer.cancel()
        job.timer = (
            None if at is None else self.loop.call_at(self.loop.time() + (at - time.monotonic()), self._due, job)
        )

    def _due(self, job: Job) -> None:
        """A deadline of `job`: its soft limit (or its hard one, without a soft one) stops it; past the time given to
        unwind (the hard limit, or CANCEL_GRACE_S after a cancel), a coroutine still running is given up."""
        job.timer = None
        if job.greenlet.dead:
            return
        if job.reason is None:
            soft = job.soft is not None and job.soft <= (job.hard or job.soft)
            limit = job.soft if soft else job.hard
            self._stop(job, SoftTimeLimitExceeded(limit) if soft else TimeLimitExceeded(limit))
        elif job.body is not None and not job.body.done():
            if job.call is not None:  # a plain job's thread: the hard limit is raised in it, late as it may come
                job.call.stop(TimeLimitExceeded)
            self._abandon(job)
            job.abandoned = True
            self._ended.append((job, None))
            job.body = None

    def _stop(self, job: Job, reason: BaseException, grace: float | None = None) -> None:
        """On the loop: stop `job` with `reason` (its coroutine cancelled; raised at once if it is outside one), giving
        it `grace` seconds (CANCEL_GRACE_S by default) to unwind."""
        if job.greenlet.dead or (job.reason is not None and not overrides(reason, job.reason)):
            return
        earlier = job.timer if job.reason is not None else None  # stopped already: its end comes no later
        job.reason = reason
        grace = CANCEL_GRACE_S if grace is None else grace
        if isinstance(reason, SoftTimeLimitExceeded) and job.hard is not None:
            grace = max(0.0, job.started + job.hard - time.monotonic())
        at = time.monotonic() + grace
        if earlier is not None:
            at = min(at, time.monotonic() + max(0.0, earlier.when() - self.loop.time()))
        self._arm(job, at)
        if job.call is not None:
            job.call.stop(type(reason))  # raised in its thread (or it ends now, if it waits for one)
        elif job.body is not None:
            job.body.cancel()

    def _abandon(self, job: Job) -> None:
        """The job's coroutine ignored its cancellation: the job ends now; the process is recycled."""
        log.error(
            "job %s ignored its cancellation (%r) for the time given to unwind: ended here; this worker process is"
            " recycled",
            job.task_id,
            job.reason,
        )
        if not isinstance(job.reason, LeaseLost):  # that attempt is counted by its request (`abandon`)
            metrics.child(metrics.jobs_abandoned, job.name).inc()
        self.recycle()

    def recycle(self) -> None:
        """A warm shutdown of this worker (its supervisor starts it again): what ran away cannot be stopped here."""
        if not self.recycling:
            self.recycling = True
            state.should_stop = 0  # type: ignore[assignment]  # typed None in celery-types; Celery's event loop raises WorkerShutdown(0) at its next iteration

    # -- stopping a job from another thread ------------------------------------------------------------------

    def stop_job(self, task_id: str, reason: type[BaseException], grace: float | None = None) -> bool:
        """Stop the job `task_id` if it runs here (from any thread): `reason` is raised in it (an async job's coroutine
        is cancelled), and it is given up after `grace` s (default CANCEL_GRACE_S). True if found."""
        twins = list(self.jobs.get(task_id, ()))  # every delivery of the id here
        if not twins or self.loop.is_closed():
            return False
        for job in twins:
            if job.call is not None:  # a plain job's thread, at once: the worker's loop may be held up (a Redis call)
                job.call.interrupt(reason)
            exc: BaseException = reason(task_id) if issubclass(reason, JobCancelled) else reason()
            self.loop.call_soon_threadsafe(self._stop, job, exc, grace)  # wakes the loop's selector: the hub runs it
        return True


def _nothing() -> None:
    """A callback that only wakes the loop's selector."""
