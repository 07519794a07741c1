"""Stopping the jobs whose lease this worker cannot renew before it lapses: a host cut off from Redis.

A worker that cannot reach Redis cannot renew its leases; once one lapses a peer's sweep gives the job to another
worker, which runs it from the start. The copy here must be stopped before that, or the job's body (an email, a
webhook) runs to its end twice. `LapseWatch`, a daemon thread of the worker's main process, checks every POLL_S on
the worker's own clock (no Redis call, so a renewal call hanging on a cut link does not delay it):

* **the stop**: a held job whose lease was last confirmed (its fetch, or the last renewal that reached Redis) more
  than two thirds of LEASE_SECONDS ago (`stop_before_lapse`: two renewal periods; one renewal may fail harmlessly,
  the second failure stops the job) is given up (`Leases.give_up`: no longer renewed, never run here if not started) and
  `LeaseLost` is raised in it, as a soft time limit is: a prefork child gets LEASE_LOST_SIGNAL (its handler raises
  it while the job's function runs); a solo worker's job gets it from the time limits' SIGALRM handler
  (`pipeline.runtime.cancels.Interrupter`, blocking calls interrupted too); a job of the asyncio pool is stopped
  through the pool (`stop_job`: an async job's coroutine cancelled, a plain job's thread given it as an asynchronous
  exception). The job may clean up for the last third of the lease;
* **the lapse** (last confirmation plus LEASE_SECONDS, less one POLL_S): a job still running ignored `LeaseLost`.
  The process is the last line: a prefork child is killed (SIGKILL); the asyncio pool gives a coroutine (or a plain
  job's thread) up and recycles the worker (`pipeline.runtime.asyncpool`); a solo worker's job, in its main thread,
  takes the worker down with it (SIGKILL of the worker: its supervisor starts it again).

The attempt is recorded as abandoned (`pipeline.delivery.request.abandon`): nothing stored, acknowledged, retried or
dead-lettered here; `pipeline_jobs_abandoned_total{task}` and `pipeline_leases_total{outcome="lapsed"}` count it. The
lease is left to lapse: a sweep (a peer's, or this worker's once it reaches Redis again) puts the job back on its
queue. A Redis outage that every worker sees stops the running jobs the same way (no worker can tell an outage from
a cut); they run again after it.

Limits: the threads pool cannot stop a running job (it finishes; its result and acknowledgement are fenced, as before).
A process frozen whole (SIGSTOP, a paused VM) stops nothing while frozen: when it thaws late the renewal thread gets
THAW_S to confirm its leases first, and a lease a peer took meanwhile is fenced (`pipeline.delivery.fencing`). A
LEASE_LOST_SIGNAL that reaches a prefork child just after its job ended can stop the next job: that attempt is
abandoned too, and the job runs again after its lease.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import time
from types import FrameType
from typing import Any

from celery import bootsteps
from celery.worker import state

from pipeline.delivery.lease import Leases
from pipeline.delivery.request import delivery_tag
from pipeline.errors import LeaseLost
from pipeline.pools import pool_kind
from pipeline.runtime.daemon import Daemon
from pipeline.task import GUARDS, PipelineTask

log = logging.getLogger(__name__)

#: How often the watch looks at the leases' deadlines, seconds.
POLL_S = 0.25
#: A wake-up this much later than planned means the process was frozen: the renewal thread gets this long first.
THAW_S = 1.0
#: Pids the shared flags of prefork children cover (Linux's largest pid_max): a larger pid is judged in its job.
PIDS = 1 << 22
#: What raises `LeaseLost` in a prefork child (Celery and billiard leave it alone there; SIGUSR1 is the soft limit).
LEASE_LOST_SIGNAL = signal.SIGUSR2


def stop_before_lapse(lease_seconds: float) -> float:
    """How long before its lease lapses a job is stopped: one renewal period (a third of the lease)."""
    return lease_seconds / 3


def _requests() -> list[Any]:
    """The worker's reserved and running requests (sets the event loop changes: copied, again if it changed)."""
    while True:
        try:
            return list(state.reserved_requests | state.active_requests)
        except RuntimeError:  # changed size while copied
            continue


class LapseWatch(Daemon):
    """The daemon thread of the module doc, for one worker."""

    thread_name = "pipeline-lease-lapses"

    def __init__(self, leases: Leases, pool: Any, interrupter: Any = None) -> None:
        self.leases = leases
        self.pool = pool
        self.kind = pool_kind(pool)
        self.interrupter = interrupter
        self.before_lapse = stop_before_lapse(leases.lease_seconds)
        super().__init__()

    def _run(self) -> None:
        last = time.monotonic()
        judge_from = last
        while not self._stopped.wait(POLL_S):
            now = time.monotonic()
            if now - last > POLL_S + THAW_S:  # frozen: let a renewal confirm the leases before judging them
                self.leases.wake()
                judge_from = now + THAW_S
            last = now
            if now < judge_from:
                continue
            try:
                self.check(now)
            except Exception:  # the next poll tries again; the thread must not die
                log.exception("lease deadlines: check failed")

    def check(self, now: float) -> None:
        """Give up the leases due (see the module doc); stop their running jobs, and at the lapse the ones that went
        on."""
        due = self.leases.due(self.before_lapse, now)
        if due:
            given = self.leases.give_up(due)
            log.error(
                "could not renew the lease of %d job(s) for %.1f s (Redis unreachable): stopping them before their"
                " lease lapses; a peer may run them once it has",
                len(given),
                self.leases.lease_seconds - self.before_lapse,
            )
        lapsing = self.leases.lapsing()
        if not lapsing:
            return
        seen: set[str] = set()
        for request in _requests():
            tag = delivery_tag(request)
            if tag is None or tag not in lapsing:
                continue
            seen.add(tag)
            if not request.time_start:
                continue  # not started: refused when it would run (`Request.revoked`)
            last_line = lapsing[tag] - POLL_S  # the lapse, less a poll: never a poll after it
            if not getattr(request, "_lease_lapsing", False):
                request._lease_lapsing = True
                self.stop_job(request, max(0.0, last_line - now))
            elif now >= last_line and not getattr(request, "_lease_lapsed", False):
                request._lease_lapsed = True
                self.end_process(request)
        gone = [tag for tag, lapse in lapsing.items() if tag not in seen and now >= lapse]
        self.leases.forget_lost(gone)  # no copy of them left here

    def stop_job(self, request: Any, grace: float) -> None:
        """Raise `LeaseLost` in the running job of `request`; `grace`: seconds it has to end (its lease lapses then)."""
        log.error(
            "job %s[%s]: its lease could not be renewed and lapses in %.1f s: stopping it (LeaseLost)",
            request.name,
            request.id,
            grace,
        )
        stop_job = getattr(self.pool, "stop_job", None)
        if stop_job is not None and stop_job(request.id, LeaseLost, grace):
            return  # an async job of the asyncio pool: its coroutine cancelled
        if self.interrupter is not None and self.interrupter.interrupt(request.id, LeaseLost):
            return  # in the worker's main thread (solo)
        pid = getattr(request, "worker_pid", None)
        if self.kind == "prefork" and pid and pid != os.getpid():
            _kill(pid, LEASE_LOST_SIGNAL)
            return
        log.error("job %s[%s]: this pool cannot stop a running job; it goes on unacknowledged", request.name,
                  request.id)  # fmt: skip

    def end_process(self, request: Any) -> None:
        """The lease lapsed and the job still runs (it ignored `LeaseLost`): the last line is its process."""
        pid = getattr(request, "worker_pid", None)
        if self.kind == "prefork" and pid and pid != os.getpid():
            if running_job.in_job(pid):
                log.error("job %s[%s] ignored LeaseLost until its lease lapsed: killing its pool process", request.name,
                          request.id)  # fmt: skip
                _kill(pid, signal.SIGKILL)
        elif self.kind == "solo":
            log.critical(
                "job %s[%s] ignored LeaseLost until its lease lapsed in the worker's main thread: stopping the worker"
                " (its supervisor starts it again)",
                request.name,
                request.id,
            )
            _kill(os.getpid(), signal.SIGKILL)
        # asyncio pool: the pool gives the job (its coroutine, or its thread) up at the lapse and recycles the worker.


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(pid, signum)


class _RunningJob:
    """The guard of a prefork child: whether a job's function runs now (LEASE_LOST_SIGNAL raises only then), also
    written to the byte of the child's pid in `flags`, a mapping shared with the worker's main process (made before the
    pool forks: `share`), so the watch can tell a child still in its job from one whose end the event loop has not read
    yet."""

    running = False
    flags: mmap.mmap | None = None

    def share(self) -> None:
        """In the worker's main process, before its pool forks: the shared mapping (one byte per possible pid; only the
        pages of the pids in use are ever touched)."""
        if self.flags is None:
            self.flags = mmap.mmap(-1, PIDS)

    def start(self, task: PipelineTask) -> None:
        self.running = True
        self._flag(1)

    def stop(self) -> None:
        self.running = False
        self._flag(0)

    def _flag(self, value: int) -> None:
        pid = os.getpid()
        if self.flags is not None and pid < PIDS:
            self.flags[pid] = value

    def in_job(self, pid: int) -> bool:
        """Whether pool process `pid` runs a job's function now (True when it cannot be told)."""
        return self.flags is None or pid >= PIDS or bool(self.flags[pid])


running_job = _RunningJob()


def _on_lease_lost(_signum: int, _frame: FrameType | None) -> None:
    if running_job.running:
        running_job.running = False  # once: the job's clean-up is not interrupted again (the flag stays up meanwhile)
        raise LeaseLost("the worker could not renew this job's lease before it lapsed")


def install_in_child() -> None:
    """In a prefork child (`worker_process_init`): LEASE_LOST_SIGNAL raises `LeaseLost` in the running job."""
    if running_job not in GUARDS:
        GUARDS.insert(0, running_job)
    running_job.stop()  # a pid used again: not in a job yet
    signal.signal(LEASE_LOST_SIGNAL, _on_lease_lost)


class LapseStep(bootsteps.StartStopStep):
    """Runs the worker's `LapseWatch` (after the delivery step, which owns the leases, and the cancel step, whose
    interrupter stops a job in the main thread)."""

    requires = ("pipeline.delivery.fencing:DeliveryStep", "pipeline.runtime.cancels:CancelStep")

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.watch: LapseWatch | None = None
        if pool_kind(getattr(parent, "pool_cls", None)) == "prefork":
            running_job.share()  # before the pool forks its children

    def start(self, parent: Any) -> None:
        self.watch = LapseWatch(parent.leases, parent.pool, getattr(parent, "interrupter", None)).start()

    def stop(self, parent: Any) -> None:
        if self.watch is not None:
            self.watch.stop()

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
