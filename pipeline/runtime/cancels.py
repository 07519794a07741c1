"""A worker's side of a cancel: the jobs it holds are dropped, the one it runs is stopped (`pipeline.control.cancel`).

A cancel writes the job's tombstone and PUBLISHes its id on `pipeline:cancel`. A message still in its queue is
dropped by the fetch (`fetch.lua`); this module handles the jobs a worker already holds. `CancelStep`, a bootstep
beside the delivery step, runs `Listener`: a daemon thread with its own Redis connection, SUBSCRIBEd to the channel
(a solo worker's event loop is blocked while a job runs, so the loop cannot be relied on). For each id it hears:

* the id joins Celery's revoked set (`celery.worker.state.revoked`, what `celery control revoke` fills): a request
  held and not started (prefetched, or a retry waiting for its countdown in the worker's timer) is discarded when it
  would run (`Request.revoked`), its state stored as REVOKED (read as `cancelled`), its message acknowledged;
* prefork: the event loop's tick (every TICK_S) terminates the request (`Request.terminate`, as Celery's revoke with
  `terminate=True` does) with SIGKILL, as the fence kills a job whose lease was lost: SIGTERM is ignored by pool
  processes under REMAP_SIGTERM=SIGQUIT (what the start scripts set). REVOKED is stored, the message acknowledged
  and its lease released; the pool process is replaced and the worker takes its next job. What the job started
  in a session of its own (ffmpeg) is not killed with it;
* asyncio pool: a job is stopped through the pool (`stop_job`: an async job's coroutine cancelled, `JobCancelled`
  raised in it; a plain job's thread gets it as an asynchronous exception, `pipeline.runtime.plainjobs`);
* solo: the job runs in the worker's thread, which no pool can kill: `Interrupter` (a guard around each job,
  `pipeline.task.GUARDS`) raises `JobCancelled` in it: on the main thread through the time limits' SIGALRM handler
  (`pipeline.runtime.timelimits`: a blocking call is interrupted too), on another thread (an embedded worker) as an
  asynchronous exception (raised at the job's next Python instruction). `JobCancelled` is Celery's `Ignore`: the
  request records the job as revoked (`pipeline.delivery.request`), never as a failure.

Celery's own revoke with terminate (`AsyncResult.revoke(terminate=True)`, `celery control terminate`, Flower's
button) stops a running job the same way: `Request.terminate` is routed to `CancelStep.stop_running` (the asyncio
pool's `stop_job`; where it finds no job of the id, the `Interrupter`; prefork: the request's pool process is
signalled). Celery's control consumer runs on the worker's main thread, which a solo job holds (and a plain job of
the asyncio pool's, briefly, while its trace runs there): in those pools the listener also hears Celery's revoke
broadcast (`pipeline.delivery.broadcasts`) and stops the job from its thread; Celery's handler runs once the thread is
free and finds the job REVOKED.

A message missed while the connection was down is caught on reconnect, and every RECHECK_S: the listener reads the
tombstones of the jobs this worker holds (its leased deliveries, from `unacked`; on a Redis Cluster each queue's
records and tombstones, in its slot) and handles those that are set.
Not handled: the threads pool (a job is not interrupted; its result is not stored over `cancelled`), and a solo
job that catches `JobCancelled` and goes on (it finishes; its state stays `cancelled`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import CodeType
from typing import Any

from celery import bootsteps
from celery.worker import state

from pipeline import cluster
from pipeline.broker import broker_redis, direct_redis
from pipeline.constants import CANCEL_CHANNEL
from pipeline.delivery import broadcasts, request
from pipeline.delivery.lease import Leases
from pipeline.errors import JobCancelled
from pipeline.pools import aio, traces_in_main_thread
from pipeline.queues import keys
from pipeline.runtime.daemon import Daemon
from pipeline.runtime.timelimits import alarm_limits
from pipeline.task import GUARDS, PipelineTask

log = logging.getLogger(__name__)

#: How often the event loop terminates the running jobs the listener heard cancelled (prefork), seconds.
TICK_S = 0.5
#: How often the listener reads the tombstones of the jobs the worker holds (a missed message), seconds.
RECHECK_S = 10.0
#: Longest wait for one call of the listener's own client (connect or answer), seconds.
CLIENT_TIMEOUT_S = 2.0


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in `thread` at its next Python instruction (None: forget one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


class Interrupter:
    """The guard around each job of a solo worker: knows the job running and raises `JobCancelled` in it once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._task_id: str | None = None
        self._thread = 0
        self._fired = False
        #: A plain Celery task's function (`start_plain`): raised in only while it runs.
        self._within: CodeType | None = None

    def start_plain(self, task: Any) -> None:
        """A plain Celery task (`@app.task`, no guards) starts on this thread (`task_prerun`): it is interrupted only
        while its function runs (never in the tracer's code around it), and only on the thread of the SIGALRM handler.
        """
        code = getattr(getattr(task, "run", None), "__code__", None)
        if code is None or not alarm_limits.installed_on(threading.get_ident()):
            return
        with self._lock:
            self._task_id, self._thread, self._fired = str(task.request.id), threading.get_ident(), False
            self._within = code

    def start(self, task: PipelineTask) -> None:
        task_id = str(task.request.id)
        with self._lock:
            self._task_id, self._thread, self._fired, self._within = task_id, threading.get_ident(), False, None
            if task_id in state.revoked:  # heard just after the request's own check
                self._fired = True
        if self._fired:
            raise JobCancelled(task_id)

    def stop(self) -> None:
        with self._lock:
            if self._fired:  # one not raised yet (the job ended first) is forgotten: it must not hit the next one
                if alarm_limits.installed_on(self._thread):
                    alarm_limits.clear_interrupt()
                else:
                    _async_raise(self._thread, None)
            self._task_id, self._fired, self._within = None, False, None

    def interrupt(self, task_id: str, exc: type[Exception] = JobCancelled) -> bool:
        """Raise `exc` in the job `task_id` if it is the one running (once: a cancel, or a lease that could not be
        renewed, `pipeline.runtime.lapses`); True if it was."""
        with self._lock:
            if self._task_id != task_id or self._fired:
                return False
            self._fired = True
            if alarm_limits.installed_on(self._thread):
                alarm_limits.interrupt(exc, self._within)
            else:
                _async_raise(self._thread, exc)
        if exc is JobCancelled:
            log.warning("job %s was cancelled while it ran: interrupting it", task_id)
        else:
            log.warning("job %s: interrupting it (%s)", task_id, exc.__name__)
        return True


#: The interrupter of this process's worker (solo, asyncio pool), for plain tasks' `task_prerun` / `task_postrun`.
_plain: Interrupter | None = None


def plain_started(task: Any) -> None:
    """`task_prerun`: a plain Celery task (not a `PipelineTask`, which is guarded) on the main thread is watched."""
    if _plain is not None and not isinstance(task, PipelineTask) and not aio.in_job():
        _plain.start_plain(task)


def plain_ended(task: Any) -> None:
    """`task_postrun`: the plain task's function has returned (or raised)."""
    if _plain is not None and not isinstance(task, PipelineTask) and not aio.in_job():
        _plain.stop()


def _held_ids(client: Any, leases: Leases) -> dict[str, str]:
    """Task id -> tombstone key of each delivery this worker holds (its leased tags, read from kombu's `unacked`: on a
    Redis Cluster each queue's own, in its slot, where the job's tombstone is too)."""
    ids: dict[str, str] = {}
    for records, tags in leases.by_records(sorted(leases.held())):
        queue = keys.tagged_queue(records[0]) or ""  # '' on a single Redis: one tombstone name for every queue
        for raw in client.hmget(records[0], tags) if tags else []:
            try:
                headers = json.loads(raw)[0].get("headers") or {}
            except (TypeError, ValueError, AttributeError, IndexError, KeyError):
                continue
            if isinstance(headers.get("id"), str):
                ids[headers["id"]] = keys.cancel(queue, headers["id"])
    return ids


class Listener(Daemon):
    """The daemon thread hearing cancels (see the module doc); `on_cancel(task_id)` for each, on this thread."""

    thread_name = "pipeline-cancel-listener"

    def __init__(self, leases: Leases, on_cancel: Callable[[str], None], revokes: Revokes | None = None) -> None:
        self.leases = leases
        self._on_cancel = on_cancel
        self._revokes = revokes
        super().__init__()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._listen(_client())
            except Exception as exc:  # noqa: BLE001  # Redis away or failing over: subscribe again, re-check
                log.warning("cancel listener: %r; listening again in a second", exc)
                self._stopped.wait(1.0)

    def _listen(self, client: Any) -> None:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        revokes = self._revokes
        broadcast = revokes.topic(client) if revokes is not None else None
        try:
            pubsub.subscribe(CANCEL_CHANNEL, *([broadcast] if broadcast else []))
            checked = 0.0
            while not self._stopped.is_set():
                if time.monotonic() - checked >= RECHECK_S:  # on (re)connect, then every RECHECK_S
                    self.recheck(client)
                    checked = time.monotonic()
                message = pubsub.get_message(timeout=1.0)
                if not message or message.get("type") != "message":
                    continue
                channel, data = _text(message["channel"]), message["data"]
                if revokes is not None and channel == broadcast:
                    revokes.heard(data)
                else:
                    self._on_cancel(_text(data))
        finally:
            pubsub.close()

    def recheck(self, client: Any) -> None:
        """Handle the held jobs whose tombstone is set (a cancel this worker did not hear)."""
        held = _held_ids(client, self.leases)
        marks = cluster.get_many(client, list(held.values()))
        for task_id, mark in zip(held, marks, strict=True):
            if mark is not None and task_id not in state.revoked:
                self._on_cancel(task_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Revokes:
    """Celery's revoke broadcasts with `terminate` for this worker (`pipeline.delivery.broadcasts`), heard on the
    listener's thread: each id is handed to `on_revoke` while the worker's main thread may be in a job."""

    def __init__(self, node: str, exchange: str, options: dict[str, Any], on_revoke: Callable[[str], None]) -> None:
        self.node = node
        self._exchange = exchange
        self._options = options
        self._on_revoke = on_revoke

    def topic(self, client: Any) -> str:
        """The broadcast topic on the database `client` is on (the broker's; a Redis Cluster has database 0 only, and
        its client no single pool)."""
        pool = getattr(client, "connection_pool", None)
        db = int(pool.connection_kwargs.get("db") or 0) if pool is not None else 0
        return broadcasts.topic(db, self._exchange, self._options)

    def heard(self, data: bytes | str) -> None:
        for task_id in broadcasts.terminated_ids(data, self.node):
            self._on_revoke(task_id)


def _client() -> Any:
    # Sentinel: a client on the app's pool, which follows failovers (its pub/sub connection is its own).
    client = direct_redis(CLIENT_TIMEOUT_S)
    if client is None:
        with broker_redis() as pooled:
            client = pooled
    return client


class CancelStep(bootsteps.StartStopStep):
    """Runs the listener; a solo worker's jobs are guarded by the `Interrupter`, a prefork worker's are terminated
    by the event loop's tick."""

    requires = ("pipeline.delivery.fencing:DeliveryStep",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.listener: Listener | None = None
        self.interrupter: Interrupter | None = None
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def start(self, parent: Any) -> None:
        self.pool = parent.pool
        revokes = None
        if traces_in_main_thread(parent.pool):
            self.interrupter = parent.interrupter = Interrupter()
            GUARDS.append(self.interrupter)  # innermost: stopped first, so nothing is left to raise after a job
            global _plain  # one worker per process
            _plain = self.interrupter  # plain Celery tasks have no guards: `plain_started` / `plain_ended`
            # The main thread, where Celery's control consumer runs, may be in a job: hear Celery's revokes here too.
            app = parent.app
            options = dict(app.conf.broker_transport_options or {})
            revokes = Revokes(parent.hostname, app.control.mailbox.exchange.name, options, self.on_revoke)
        else:
            timer = parent.hub if getattr(parent, "use_eventloop", False) else parent.timer
            timer.call_repeatedly(TICK_S, self.tick)
        request.stop_running_with(self.stop_running)  # Celery's revoke with terminate stops a job as a cancel does
        self.listener = Listener(parent.leases, self.on_cancel, revokes).start()

    def stop(self, parent: Any) -> None:
        request.stop_running_with(None)
        if self.listener is not None:
            self.listener.stop()
        if self.interrupter in GUARDS:
            GUARDS.remove(self.interrupter)
        global _plain
        if _plain is self.interrupter:
            _plain = None

    def terminate(self, parent: Any) -> None:
        self.stop(parent)

    def stop_running(self, task_id: str) -> bool:
        """Stop the job `task_id` if it runs in this process, from any thread, as a cancel does: the asyncio pool's
        `stop_job` (`JobCancelled` raised in it; its coroutine cancelled), and where that finds no job of the id, the
        `Interrupter` (solo; a plain job of the asyncio pool). False: not running here (a prefork worker's job runs
        in a pool process: its request is terminated instead)."""
        stop_job = getattr(self.pool, "stop_job", None)
        if stop_job is not None and stop_job(task_id, JobCancelled):
            log.warning("job %s was cancelled while it ran: stopping it", task_id)
            return True
        return self.interrupter is not None and self.interrupter.interrupt(task_id)

    def on_cancel(self, task_id: str) -> None:
        """The listener heard `task_id` cancelled (its thread)."""
        state.revoked.add(task_id)  # held and not started: discarded when it would run (Request.revoked)
        if not self.stop_running(task_id) and self.interrupter is None:  # prefork: the tick terminates its request
            with self._lock:
                self._pending.add(task_id)

    def on_revoke(self, task_id: str) -> None:
        """The listener heard Celery's revoke of `task_id` with terminate (its thread; a solo or asyncio pool)."""
        state.revoked.add(task_id)  # what Celery's own handler adds once the main thread is free
        self.stop_running(task_id)

    def tick(self) -> None:
        """Prefork, on the event loop: terminate the requests of the cancelled ids, started or handed to the pool."""
        with self._lock:
            pending, self._pending = self._pending, set()
        if not pending:
            return
        requests = set(state.active_requests) | set(state.reserved_requests)
        for held in requests:
            if held.id in pending and not getattr(held, "_lease_lost", False):
                log.warning("job %s[%s] was cancelled: terminating it", held.name, held.id)
                held.terminate(self.pool, signal=signal.SIGKILL)
