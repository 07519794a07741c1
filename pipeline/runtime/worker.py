"""The `celery worker` process: a prompt shutdown, and a soft shutdown only when the worker holds jobs.

* Celery's soft shutdown (WORKER_SOFT_SHUTDOWN_TIMEOUT; SIGTERM is remapped to SIGQUIT by the start scripts)
  lets running jobs finish before a cold shutdown requeues the rest. It runs inside the signal handler and
  sleeps the whole timeout (`celery/worker/worker.py: WorkController.wait_for_soft_shutdown`). With
  `worker_enable_soft_shutdown_on_idle` it does so even when the worker is idle; without it, it skips jobs
  held with an ETA. `Worker` sleeps it when the worker holds any job, running or reserved, and never when it
  holds none.
* A shutdown signal only sets a flag that the event loop reads after its next poll, which sleeps up to a
  second when nothing is scheduled (Python retries an interrupted poll, PEP 475). `PromptShutdown` wakes
  the loop every WAKE_S seconds, so an idle worker, and `pipeline run` on Ctrl-C, stop within about 2 s.
* A worker asked to consume the dead-letter queue (`-Q default,dead_letter`) would take every envelope
  for a message it cannot run and refuse it. `Worker.setup_queues` (after Celery applied `-Q`/`-X`,
  `celery/worker/worker.py: WorkController.setup_queues`) refuses to start instead: one line on
  stderr naming the queue, exit status 2.
* A solo worker (`-P solo`, the I/O profile) gets soft and hard time limits from a timer in its main
  thread (`pipeline.runtime.timelimits`): Celery enforces none in that pool. Its job runs in the thread
  that handles the shutdown signal, so a soft shutdown could only pause it: it skips the wait, and the
  running job goes back to its queue at once (and runs again: jobs are idempotent).
* The worker consumes through the delivery layer's transport (`consumes_through_leases`: the delivery bootstep,
  `pipeline.delivery.fencing.DeliveryStep`, binds it to the worker's leases before any connection): queue
  elements that are not messages are dead-lettered instead of stopping it, each delivery is fetched and leased in
  one step, and jobs running when the connection drops go on and are acknowledged once it is back.
* An asyncio-pool worker (`-P custom`, `pipeline.runtime.asyncpool`; what `pipeline worker` runs) keeps
  WORKER_CONCURRENCY jobs in flight (unless `-c` says otherwise) and prefetches no more than that (multiplier 1), a
  few at a time (`pipeline.delivery.fetch.FETCH_MAX_IN_FLIGHT`). It traces jobs in its main thread as a solo worker
  does (carried results, decoded bodies); a plain job's function runs on one of its threads
  (`pipeline.runtime.plainjobs`), its time limits enforced by the pool, not by the solo pool's timer. Its soft
  shutdown lets the jobs in flight finish (`pipeline.runtime.asyncshutdown`) and gives back what cannot. Its shutdown
  signals are handled at a safe point of the pool's (`pipeline.runtime.asyncsignals`). A second SIGTERM during the
  soft shutdown (a supervisor passing on what systemd sent the whole group) is ignored: SIGQUIT and SIGINT still stop
  the jobs.
* The tracer writes a plain result's text with Python's `repr` (`pipeline.compat.resultrepr`, installed in
  `on_before_init`), not with Celery's much slower walker.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import bootsteps, platforms
from celery.apps.worker import Worker as CeleryWorker
from celery.worker import state

from pipeline.compat import resultrepr
from pipeline.config import get_settings
from pipeline.config.celery import WORKER_RESULT_RETRIES, prefetch_multiplier, worker_profile
from pipeline.constants import DEAD_LETTER_QUEUE
from pipeline.delivery import acks, fetch, request
from pipeline.pools import is_asyncio, is_solo, traces_in_main_thread
from pipeline.runtime import timelimits
from pipeline.runtime.stall import mark_stopping, running_job
from pipeline.task import GUARDS

log = logging.getLogger(__name__)

#: Longest time the worker's event loop sleeps before it looks at a pending shutdown.
WAKE_S = 0.25


#: Exit status of a worker that refuses to start (a usage error, as for a bad setting).
EX_REFUSED = 2


def refuse_dead_letter_queue(queues: Any) -> None:
    """Exit (status 2, one line on stderr) when `queues`, the names a worker would consume, hold the DLQ."""
    if DEAD_LETTER_QUEUE in set(queues):
        print(
            f"pipeline: refusing to start: a worker never consumes the dead-letter queue {DEAD_LETTER_QUEUE!r}"
            " (remove it from -Q; use `pipeline dlq` to list and replay its entries)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EX_REFUSED)


class Worker(CeleryWorker):
    #: `short` or `long` (`pipeline.config.celery.worker_profile`), known once the queues are.
    profile = "short"
    #: The delivery bootstep binds the delivery layer's transport to this worker's leases.
    consumes_through_leases = True

    def on_before_init(self, quiet: bool = False, **kwargs: Any) -> None:
        # Results of jobs that finish during an outage are stored once Redis is back (they keep their lease).
        self.app.conf.update(WORKER_RESULT_RETRIES)
        resultrepr.install()  # before the pool starts: prefork children inherit it
        super().on_before_init(quiet=quiet, **kwargs)

    def setup_defaults(self, concurrency: int | None = None, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # keywords passed on
        defaults = super().setup_defaults(concurrency=concurrency, **kwargs)
        if is_asyncio(getattr(self, "pool_cls", None)) and not concurrency and not self.app.conf.worker_concurrency:
            self.concurrency = get_settings().worker_concurrency  # jobs in flight, not processes
        return defaults

    def setup_queues(self, include: Any, exclude: Any = None) -> None:
        super().setup_queues(include, exclude)
        queues = set(self.app.amqp.queues.consume_from)
        refuse_dead_letter_queue(queues)
        self.apply_profile(queues)
        if traces_in_main_thread(getattr(self, "pool_cls", None)):
            acks.enable_carried_results()  # a job's result is stored by the call that acknowledges it
            request.enable_decoded_bodies()  # the job is traced here: its body is decoded once, not twice
        if is_solo(getattr(self, "pool_cls", None)):  # the job's function runs in the main thread
            timelimits.enable()  # Celery enforces no time limit in the solo pool: a timer in the main thread does
            if running_job not in GUARDS:  # a job blocks the event loop: the heartbeat is kept up meanwhile
                GUARDS.append(running_job)

    def apply_profile(self, queues: set[str]) -> None:
        """The worker profile's prefetch, now that the queues are known (before the consumer exists). A
        multiplier given explicitly (WORKER_PREFETCH_MULTIPLIER, or `--prefetch-multiplier` other than the
        configured one) stays."""
        settings = get_settings()
        profile = worker_profile(settings, queues)
        given = int(getattr(self, "prefetch_multiplier", 0))  # set by Celery's `setup_defaults`
        if settings.worker_prefetch_multiplier is None and given == int(self.app.conf.worker_prefetch_multiplier):
            # The asyncio pool holds no more than it runs: its limit is already the jobs in flight.
            given = 1 if is_asyncio(getattr(self, "pool_cls", None)) else prefetch_multiplier(settings, profile)
        self.prefetch_multiplier = given
        self.profile = profile
        if is_asyncio(getattr(self, "pool_cls", None)):
            fetch.in_flight_pool()  # small batches: many jobs in flight are refilled as their slots free

    def on_start(self) -> None:
        super().on_start()  # logging is set up from here on
        if is_asyncio(getattr(self, "pool_cls", None)):
            in_flight = self.concurrency
            log.info("worker profile %s: asyncio pool, %d jobs in flight at most, late acks", self.profile, in_flight)
        else:
            log.info("worker profile %s: prefetch %d per process, late acks", self.profile, self.prefetch_multiplier)
        settings = get_settings()
        if settings.visibility_timeout is not None:
            log.warning(
                "VISIBILITY_TIMEOUT=%d is no longer read: a dead worker's jobs come back after LEASE_SECONDS=%d "
                "plus a sweep (docs/leases.md); remove the setting",
                settings.visibility_timeout,
                settings.lease_seconds,
            )

    def install_platform_tweaks(self, worker: Any) -> None:
        super().install_platform_tweaks(worker)  # Celery's signal handlers
        if is_asyncio(getattr(self, "pool_cls", None)):
            pool: Any = self.pool
            pool.signals.install()  # handled outside the jobs and the loop's iteration (`asyncsignals`)

    def wait_for_soft_shutdown(self) -> Any:
        if not (state.active_requests or state.reserved_requests):
            return None
        timeout = float(self.app.conf.worker_soft_shutdown_timeout or 0)
        if is_asyncio(getattr(self, "pool_cls", None)):
            # The jobs in flight go on here (their traces run in this thread), up to the timeout; the rest go back.
            # A second SIGTERM (a supervisor passing on what systemd sent the whole group) is not an escalation:
            # Celery's would cancel the jobs in flight; SIGQUIT and SIGINT still do.
            platforms.signals["SIGTERM"] = _already_stopping
            mark_stopping(timeout)
            pool: Any = self.pool
            if not pool.drain(timeout):
                # Stopped here as given back, before Celery's `cancel_active_requests`, which stops at a plain job
                # running below this handler (it unwinds it with WorkerTerminate) and would leave the rest unmarked.
                log.warning("%d job(s) still in flight after the soft shutdown: they go back to their queues",
                            pool.in_flight)  # fmt: skip
                pool.give_back()
            return None
        if is_solo(getattr(self, "pool_cls", None)):
            # The job runs in this thread, under this signal handler: sleeping would pause it, not let it
            # finish. Cold shutdown at once: the running job goes back to its queue now, not in N seconds.
            log.warning("solo worker: the running job is requeued now (it cannot finish during a soft shutdown)")
            return None
        # The soft shutdown sleeps in the signal handler, so the event loop (and the heartbeat) stops meanwhile.
        mark_stopping(timeout)
        return super().wait_for_soft_shutdown()


def _already_stopping(*_: Any) -> None:
    log.warning("SIGTERM again during the soft shutdown: ignored (the jobs in flight go on; SIGQUIT stops them)")


def _wake() -> None:
    """Nothing to do: the timer only bounds the event loop's poll timeout."""


class PromptShutdown(bootsteps.StartStopStep):
    requires = ("celery.worker.components:Hub",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(getattr(parent, "use_eventloop", False))

    def start(self, parent: Any) -> None:
        parent.hub.call_repeatedly(WAKE_S, _wake)
