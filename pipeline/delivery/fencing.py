"""The delivery bootstep: owns a worker's `Leases`, runs their renewal, and fences the jobs whose lease was lost.

`DeliveryStep` creates the worker's `Leases` (LEASE_SECONDS, the node name) and, for a worker that consumes through
the pipeline's transport (`celery worker` does: `consumes_through_leases` on its class), binds that transport to
them (`pipeline.delivery.transport.bound`). Before anything connects it checks the libraries the delivery layer
reaches into (`pipeline.compat.versions.require`: a worker on unverified versions refuses to start, exit status 2,
unless ALLOW_UNVERIFIED_VERSIONS=true). At start it starts the renewal thread with a Redis client of its own (short
timeouts; the app's pool for Sentinel); at stop it writes what waits for Redis and stops the thread.

Every FENCE_INTERVAL_S the event loop (or the worker's timer, for pools without one) looks at the tags the thread
found lost: a reserved request (waiting for a pool process) is dropped without running, a running one is
terminated (SIGKILL of its pool process: the job is a peer's now, nothing of it may go on); neither is acknowledged
in Redis (kombu's slot is freed). A lost request still waiting for its ETA is refused when it comes due
(`Request.revoked`). The solo and threads pools cannot terminate a running job: it finishes, and its
acknowledgement is fenced.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from celery import bootsteps
from celery.worker import state

from pipeline.broker import broker_redis, direct_redis
from pipeline.compat import versions
from pipeline.config import get_settings
from pipeline.config.celery import is_sentinel
from pipeline.config.cluster import is_cluster
from pipeline.delivery import acks, clustered, handed, replicas, transport
from pipeline.delivery.lease import Leases, Renewer
from pipeline.delivery.request import delivery_tag, drop_lost

log = logging.getLogger(__name__)

FENCE_INTERVAL_S = 0.5


#: The libraries the delivery layer reaches into (`pipeline.delivery.ENTRIES`).
LIBRARIES = ("celery", "kombu", "billiard", "redis")
#: Longest wait for one call of the renewal thread's own client (connect or answer).
CLIENT_TIMEOUT_S = 2.0


class _PoolClient:
    """Sentinel: the scripts run through the app's broker pool (it follows failovers)."""

    def evalsha(self, *args: Any) -> Any:
        with broker_redis() as client:
            return client.evalsha(*args)

    def script_load(self, source: Any) -> Any:
        with broker_redis() as client:
            return client.script_load(source)

    def run_replicated(self, name: str, keys: list[Any], args: list[Any], what: str) -> Any:
        """A script and its WAIT on one connection of the pool (`pipeline.delivery.replicas.run`)."""
        with broker_redis() as client:
            return replicas.run(client, name, keys, args, what)


def _client() -> Any:
    return direct_redis(CLIENT_TIMEOUT_S) or _PoolClient()


def fence(leases: Leases, requests: Any, pool: Any, lost: set[str]) -> set[str]:
    """Drop or terminate the requests among `requests` whose delivery tag is in `lost`; return the tags handled."""
    handled: set[str] = set()
    for request in list(requests):
        tag = delivery_tag(request)
        if tag not in lost or getattr(request, "_lease_lost", False):
            continue
        request._lease_lost = True
        if request.time_start:
            log.error("job %s[%s]: lease lost to another worker; terminating it here", request.name, request.id)
            try:
                request.cancel(pool, signal=signal.SIGKILL, emit_retry=False)
            except NotImplementedError:  # solo, threads: a running job cannot be stopped; its ack is fenced
                log.error(
                    "job %s[%s]: this pool cannot terminate it; it finishes unacknowledged", request.name, request.id
                )
        else:
            _unqueue(request, pool)
        drop_lost(request, leases)
        handled.add(tag)
    return handled


def _unqueue(request: Any, pool: Any) -> None:
    """A request handed to the pool but not started: take it out of the prefork pool's outbound buffer, as
    Celery does for a revoked job it finds there (`celery/concurrency/asynpool.py`: `_put_back`), so no process
    ever starts it; one already written to a process is killed as that process accepts it (`on_accepted` runs
    `_terminate_on_ack`)."""
    request._terminate_on_ack = (pool, signal.SIGKILL)
    result = request._apply_result() if request._apply_result is not None else None
    outbound = getattr(getattr(pool, "_pool", None), "outbound_buffer", None)
    if result is None or outbound is None or result not in outbound:
        return
    outbound.remove(result)
    result._ack(None, time.time(), os.getpid(), None)
    result._set_terminated(signal.SIGKILL)  # its error callback is Request.on_failure: nothing stored


def _kept_on_close(pool: Any, jobs: list[Any]) -> set[str]:
    """Tags of the requests that survive Celery's `Consumer.on_close`: running, or handed to the pool and run there
    (a prefork pool runs those written to a process's pipe, `jobs`: `pipeline.delivery.handed`, which are kept
    through the pool's flush). Their acknowledgements come when they end: a connection that drops again as the
    consumer reconnects must not give up the lease of a job that runs, or a sweep runs it a second time."""
    kept = {delivery_tag(request) for request in state.active_requests}
    flushed = handed.flushed(pool)
    written = {id(job) for job in jobs}
    for request in state.reserved_requests:
        result = request._apply_result() if request._apply_result is not None else None
        if result is not None and (not flushed or id(result) in written):
            kept.add(delivery_tag(request))
    return {tag for tag in kept if tag is not None}


def _release_what_on_close_drops(leases: Leases, consumer: Any, pool: Any) -> None:
    """After a lost connection Celery's `Consumer.on_close` (`celery/worker/consumer/consumer.py`) forgets the
    requests it reserved or scheduled and flushes the pool, which forgets the jobs its processes have not taken yet:
    "the broker may redeliver these tasks". With leases it would not (this worker renews them): the jobs already in a
    process's pipe are put back in the pool's table (they run: `pipeline.delivery.handed`), and the leases of the
    others are given up."""
    close = consumer.on_close

    def on_close() -> None:
        jobs = handed.in_pipes(pool)
        kept = _kept_on_close(pool, jobs)
        try:
            close()
        finally:
            handed.keep(pool, jobs)
        if jobs:
            log.info("kept %d job(s) written to pool processes through the lost connection", len(jobs))
        leases.drop(leases.held() - kept)

    consumer.on_close = on_close


class DeliveryStep(bootsteps.StartStopStep):
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        settings = get_settings()
        on_cluster = is_cluster(settings.broker_url)
        node = getattr(parent, "hostname", None)
        self.leases = parent.leases = Leases(settings.lease_seconds, node, cluster=on_cluster)
        self.renewer: Renewer | None = None
        if getattr(parent, "consumes_through_leases", False):
            versions.require("worker", LIBRARIES, settings.allow_unverified_versions)
            if on_cluster:  # per-queue fetch, leases and restores (`pipeline.delivery.clustered`)
                parent.app.conf.broker_transport = clustered.bound(self.leases)
                return
            parent.app.conf.broker_transport = transport.bound(self.leases, is_sentinel(settings.broker_url))
            from pipeline.delivery import failover  # the transport kept when kombu switches to the next URL

            failover.install(parent.app)

    def start(self, parent: Any) -> None:
        self.worker = parent
        self.renewer = Renewer(self.leases, _client).start()
        _release_what_on_close_drops(self.leases, parent.consumer, parent.pool)
        timer = parent.hub if getattr(parent, "use_eventloop", False) else parent.timer
        timer.call_repeatedly(FENCE_INTERVAL_S, self.tick)
        log.info(
            "leases: %s s, renewed every %.1f s by %s",
            self.leases.lease_seconds,
            self.leases.lease_seconds / 3,
            self.leases.owner(),
        )

    def close(self, parent: Any) -> None:
        # First of a shutdown (Celery closes every step, in boot order, before it stops any), after the pool's close
        # (a warm shutdown's jobs finish there): the acknowledgements Celery scheduled for the event loop's next
        # iteration land now, while the connection is open and the leases renewed.
        acks.land(getattr(parent, "hub", None))

    def stop(self, parent: Any) -> None:
        # Last: results and acknowledgements of jobs that finished while Redis was away (the soft shutdown lets
        # them end), so they are not delivered again after the lease; leases given up, so they come back now.
        if self.leases.has_pending():
            try:
                self.leases.renew_once(_client())
            except Exception:  # noqa: BLE001  # Redis still away: the jobs come back after the lease
                log.warning("could not apply %d acknowledgement(s) before exiting", self.leases.pending_acks())
        if self.renewer is not None:
            self.renewer.stop()

    def terminate(self, parent: Any) -> None:
        self.stop(parent)

    def tick(self) -> None:
        lost = self.leases.take_lost()
        if lost:
            fence(self.leases, set(state.reserved_requests) | set(state.active_requests), self.worker.pool, lost)
