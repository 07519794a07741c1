"""The asyncio pool: one worker process keeps WORKER_CONCURRENCY jobs in flight (`-P custom`, what `pipeline worker`
runs for the I/O queues).

Celery's tracer is synchronous, so each job's trace (signals, the typed task's wrapper, the result, the
acknowledgement) runs as it does in any pool; only where the job goes differs:

* an `async def` task (`PipelineTask.is_async`: `webhooks.deliver`, `email.send`) is traced in a greenlet on the
  process's event loop thread (`pipeline.pools.aio.JobGreenlet`). When the task's function returns its coroutine, the
  greenlet switches to the loop, which awaits it as a task of its own among every other job's, and switches back
  with its result or exception. The trace's own Redis calls (result, acknowledgement) block the loop for their
  round trip, as a short Python step would. Celery's request context is per greenlet (`celery.utils.threads` uses
  greenlet's identity when greenlet is installed), so each job sees its own `task.request`;
* a plain (sync) task runs on one of WORKER_THREADS threads, so a blocking job never stalls the loop.

Backpressure: Celery's prefetch is the pool's limit times the multiplier, and the worker sets the multiplier to 1
for this pool (`pipeline.runtime.worker`), so it never holds more unacknowledged jobs than it may run at once.

Per job, on the loop: the soft time limit cancels the coroutine and raises `SoftTimeLimitExceeded` in the job (it
fails, retried or dead-lettered as any error); a job whose coroutine ignores its cancellation until the hard limit
(or CANCEL_GRACE_S after a cancel) ends there with `TimeLimitExceeded` (or its cancel), is reported, and the
process is recycled: a warm shutdown, after which `pipeline worker` starts it again. A sync job gets the same
exceptions raised in its thread (`PyThreadState_SetAsyncExc`: at its next Python instruction). A cancel of a running
job (`pipeline.runtime.cancels`) or a lease lost to a peer (`pipeline.delivery.fencing`) reaches the job through
`stop_job` (`pipeline.delivery.request.Request.terminate`/`cancel`): `JobCancelled` is raised in it.

A warm shutdown waits for the jobs in flight (Celery's soft shutdown bounds it with WORKER_SOFT_SHUTDOWN_TIMEOUT);
a cold one stops them and their messages go back to their queues when the worker closes its connection.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery.concurrency.base import BasePool, apply_target
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.worker import state

from pipeline.config import get_settings
from pipeline.errors import JobCancelled
from pipeline.observability import metrics
from pipeline.pools import aio

log = logging.getLogger(__name__)

#: How long a stopped (cancelled) coroutine may take to unwind before it is abandoned and the process recycled.
CANCEL_GRACE_S = 2.0
#: Exit status of a worker process that leaves with a sync job stuck past its hard limit (its supervisor restarts it).
EX_STUCK = 70
#: What `pipeline worker` passes (`-P custom` with CELERY_CUSTOM_WORKER_POOL naming this class).
POOL = "pipeline.runtime.asyncpool:AsyncPool"


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in `thread` at its next Python instruction (None: forget one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


class Job:
    """One job in flight: its trace's arguments, its limits, and how to stop it."""

    __slots__ = ("abandoned", "accept", "args", "body", "callback", "done", "give_up_at", "hard", "lock", "name",
                 "reason", "soft", "started", "task_id", "thread", "timers", "wake")  # fmt: skip

    def __init__(self, args: Any, callback: Any, accept: Any, soft: float | None, hard: float | None) -> None:
        self.args = args
        self.callback = callback
        self.accept = accept
        self.name = str(args[1])  # args: the tracer, then (task name, task id, request, body, ...)
        self.task_id = str(args[2])
        self.soft = soft
        self.hard = hard
        self.started = time.monotonic()
        self.body: asyncio.Task[Any] | None = None
        self.wake: asyncio.Future[None] | None = None
        #: The exception the job is being stopped with (a limit or a cancel), once stopped.
        self.reason: BaseException | None = None
        self.give_up_at: float | None = None
        self.thread = 0
        self.lock = threading.Lock()
        self.done = False
        #: A sync job stuck past its hard limit: no longer counted in flight (a warm shutdown does not wait for it).
        self.abandoned = False
        self.timers: list[asyncio.TimerHandle] = []

    def deadline(self, limit: float | None) -> float | None:
        return None if limit is None else self.started + limit


class AsyncPool(BasePool):
    """See the module doc."""

    body_can_be_buffer = True
    signal_safe = False
    #: `pipeline.pools.pool_kind` names it by its module.
    is_green = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads = get_settings().worker_threads
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="pipeline-sync")
        self.loop = asyncio.new_event_loop()
        self.jobs: dict[str, Job] = {}
        self._idle = threading.Condition()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run_loop, name="pipeline-jobs", daemon=True)
        self._pid = os.getpid()
        self.recycling = False

    # -- lifecycle -------------------------------------------------------------------------------------------

    def on_start(self) -> None:
        self._pid = os.getpid()
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            self.loop.run_until_complete(aio.close_loop_resources())
        finally:
            self.loop.close()

    def on_stop(self) -> None:
        """Warm shutdown: the jobs in flight finish (Celery's soft shutdown bounds how long), then the loop stops."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)
        self._close()
        stuck = [job.task_id for job in list(self.jobs.values()) if job.abandoned and not job.done]
        if stuck:
            # Their threads would hold the interpreter's exit (it joins them): leave now. Their deliveries come back
            # after their lease, counted towards MAX_DELIVERIES.
            log.critical("exiting with %d job(s) stuck past their hard time limit: %s", len(stuck), ", ".join(stuck))
            logging.shutdown()
            os._exit(EX_STUCK)

    def on_terminate(self) -> None:
        """Cold shutdown: what still runs is stopped; its messages go back when the connection closes."""
        for job in list(self.jobs.values()):
            self.stop_job(job.task_id, JobCancelled)
        self._close()

    def _close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def num_processes(self) -> int:
        return int(self.limit or 0)

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
        hard = timeout or self.options.get("timeout") or None
        soft = soft_timeout or self.options.get("soft_timeout") or None
        job = Job((target, *args), callback, accept_callback, soft, hard)
        with self._idle:
            self._in_flight += 1
        self.jobs[job.task_id] = job
        task = self.app.tasks.get(args[0]) if self.app is not None else None
        if getattr(task, "is_async", False):
            self.loop.call_soon_threadsafe(self._spawn, job)
        else:
            self.executor.submit(self._run_sync, job)

    def _trace(self, job: Job) -> None:
        target, *args = job.args
        try:
            apply_target(target, tuple(args), None, job.callback, job.accept, pid=self._pid)
        except BaseException:  # the tracer handled the job's own errors; this is the pool's bookkeeping failing
            log.exception("job %s: its trace raised", job.task_id)

    def _finished(self, job: Job) -> None:
        with job.lock:
            job.done = True
            if job.thread and job.reason is not None:
                _async_raise(job.thread, None)  # one not raised yet must not hit the thread's next job
        for timer in job.timers:
            timer.cancel()
        if self.jobs.get(job.task_id) is job:
            del self.jobs[job.task_id]
        if not job.abandoned:
            self._leave(job)

    def _leave(self, job: Job) -> None:
        """`job` no longer counts in flight."""
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    # -- async jobs: a greenlet on the loop ------------------------------------------------------------------

    def _spawn(self, job: Job) -> None:
        self.loop.create_task(self._drive(job))

    async def _drive(self, job: Job) -> None:
        runner = aio.JobGreenlet(self._trace)
        try:
            value = runner.switch(job)
            while not runner.dead:
                try:
                    result = await self._await_body(job, value)
                except BaseException as exc:  # noqa: BLE001  # the job's exception goes back into its trace
                    value = runner.throw(exc)
                else:
                    value = runner.switch(result)
        finally:
            self._finished(job)

    async def _await_body(self, job: Job, coro: Any) -> Any:
        body = job.body = self.loop.create_task(coro)
        job.wake = self.loop.create_future()
        soft_at, hard_at = job.deadline(job.soft), job.deadline(job.hard)
        while not body.done():
            deadline = (soft_at or hard_at) if job.reason is None else job.give_up_at
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait({body, job.wake}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if body.done():
                break
            if job.wake.done():
                job.wake = self.loop.create_future()
            now = time.monotonic()
            if job.reason is None and deadline is not None and now >= deadline:
                limit = job.soft if deadline == soft_at else job.hard
                self._stop(job, SoftTimeLimitExceeded(limit) if deadline == soft_at else TimeLimitExceeded(limit))
            elif job.reason is not None and job.give_up_at is not None and now >= job.give_up_at:
                self._abandon(job, body)
                if isinstance(job.reason, SoftTimeLimitExceeded) and job.hard is not None:
                    raise TimeLimitExceeded(job.hard)  # it ran on to its hard limit
                raise job.reason
        job.body = None
        if body.cancelled() or isinstance(body.exception(), asyncio.CancelledError):
            raise job.reason if job.reason is not None else JobCancelled(job.task_id)
        return body.result()

    def _stop(self, job: Job, reason: BaseException) -> None:
        """On the loop: stop `job` with `reason` (its coroutine cancelled, or its thread interrupted)."""
        if job.done or job.reason is not None:
            return
        job.reason = reason
        grace = CANCEL_GRACE_S
        if isinstance(reason, SoftTimeLimitExceeded) and job.hard is not None:
            grace = max(0.0, job.started + job.hard - time.monotonic())
        job.give_up_at = time.monotonic() + grace
        if job.body is not None:
            job.body.cancel()
            if job.wake is not None and not job.wake.done():
                job.wake.set_result(None)
        elif job.thread:
            self._interrupt(job, type(reason))

    def _abandon(self, job: Job, body: asyncio.Task[Any]) -> None:
        """The job's coroutine ignored its cancellation: the job ends now; the process is recycled."""
        log.error(
            "job %s ignored its cancellation (%r) for %.1f s: ended here; this worker process is recycled",
            job.task_id,
            job.reason,
            CANCEL_GRACE_S,
        )
        metrics.child(metrics.jobs_abandoned, job.name).inc()
        self.recycle()

    def recycle(self) -> None:
        """A warm shutdown of this worker (its supervisor starts it again): what ran away cannot be stopped here."""
        if not self.recycling:
            self.recycling = True
            state.should_stop = 0  # type: ignore[assignment]  # typed None in celery-types; Celery's event loop raises WorkerShutdown(0) at its next iteration

    # -- sync jobs: a thread each ----------------------------------------------------------------------------

    def _run_sync(self, job: Job) -> None:
        job.thread = threading.get_ident()
        if job.soft or job.hard or job.reason is not None:
            self.loop.call_soon_threadsafe(self._arm, job)
        try:
            self._trace(job)
        finally:
            self._finished(job)

    def _arm(self, job: Job) -> None:
        if job.done:
            return
        if job.reason is not None:  # stopped before its thread started
            self._interrupt(job, type(job.reason))
        for limit, exc in ((job.soft, SoftTimeLimitExceeded), (job.hard, TimeLimitExceeded)):
            if limit:
                at = max(0.0, job.started + limit - time.monotonic())
                job.timers.append(self.loop.call_later(at, self._limit_sync, job, exc))

    def _limit_sync(self, job: Job, exc: type[BaseException]) -> None:
        if job.done:
            return
        job.reason = exc()
        self._interrupt(job, exc)
        if exc is TimeLimitExceeded:  # one stuck outside Python (a C call) ignores it: reported and recycled
            job.timers.append(self.loop.call_later(CANCEL_GRACE_S, self._check_sync, job))

    def _check_sync(self, job: Job) -> None:
        with job.lock:
            if job.done or job.abandoned:
                return
            job.abandoned = True
        self._leave(job)
        log.error("job %s runs on past its hard time limit (blocked outside Python?): recycling", job.task_id)
        metrics.child(metrics.jobs_abandoned, job.name).inc()
        self.recycle()

    def _interrupt(self, job: Job, exc: type[BaseException]) -> None:
        with job.lock:
            if not job.done and job.thread:
                _async_raise(job.thread, exc)

    # -- stopping a job from another thread ------------------------------------------------------------------

    def stop_job(self, task_id: str, reason: type[BaseException]) -> bool:
        """Stop the job `task_id` if it runs here (any thread): `reason` is raised in it. True if it was found."""
        job = self.jobs.get(task_id)
        if job is None or self.loop.is_closed():
            return False
        if reason is JobCancelled:
            exc: BaseException = JobCancelled(task_id)
        else:
            exc = reason()
        self.loop.call_soon_threadsafe(self._stop, job, exc)
        return True
