"""The stall watchdog: a worker that is connected but no longer fetches, or whose event loop stopped, says so.

Celery/kombu can leave a worker connected to Redis with its consumer no longer asking for messages after a
reconnection (celery/celery#8082, #9054, #10205): the process lives, its queues fill, nothing runs. Kombu's
Redis channel only issues BRPOP while `QoS.can_consume()` allows it (`kombu/transport/virtual/base.py:
QoS.can_consume`, `kombu/transport/redis.py: MultiChannelPoller._register_BRPOP`); once the consumer's
channel has dropped out of the poller no error is raised anywhere. `StallWatchdog`, a worker bootstep,
watches the outcome instead of the cause:

* a hub timer (`celery/worker/components.py: Hub`; it runs on the event loop, so it stops when the loop
  stops) rewrites the node's heartbeat file (`pipeline.observability.health`) every few seconds: a loop that
  no longer turns leaves the file stale;
* every message the consumer fetches records the time of the last fetch: the watchdog wraps the worker
  consumer's `create_task_handler`, whose handler `celery/worker/loops.py: asynloop` installs as
  `task_consumer.on_message` on every (re)connection, so refused and unknown messages count too (the
  `task_received` signal is sent only for tasks Celery accepted);
* a reader thread counts the ready jobs (LLEN over every priority sub-queue, `pipeline.broker.queue_keys`)
  of the queues the worker was started to consume plus those it consumes now, a paused queue's counted as none
  (`pipeline.scheduling.pause`: its jobs wait by design); it runs off the loop, so a slow broker never blocks the
  worker.

While those queues hold ready jobs, the consumer's channel has room (`QoS.can_consume()`: fewer unacknowledged
messages than the prefetch limit) and nothing was fetched, for STALL_TIMEOUT seconds on end, the heartbeat is
marked `stalled` with the reason and a WARNING line says why; the first fetch clears it. A queue the worker
stopped consuming (`cancel_consumer`) while jobs wait on it counts as a stall: the worker was deployed for it.
When Redis cannot be read, nothing is judged (the worker could not fetch either) and the reader thread
keeps the heartbeat fresh, since the consumer reconnects outside the event loop: an outage restarts no
worker. The solo pool runs jobs on the event loop, so the loop's timer stops during a job: while a job runs
there (`running_job`, installed for solo workers), the reader thread keeps the heartbeat fresh, up to the
job's hard time limit plus STALL_TIMEOUT; a job still running past that (it defeated its time limits) leaves
the heartbeat stale, and the probe restarts the worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import bootsteps
from kombu.utils.encoding import bytes_to_str

from pipeline.broker import broker_redis, direct_redis, queue_keys
from pipeline.config import get_settings
from pipeline.constants import PAUSED_KEY
from pipeline.observability.health import OK, STALLED, STOPPING, health_path, write_heartbeat
from pipeline.runtime import timelimits

logger = logging.getLogger(__name__)

#: Longest wait for one read of the queues' lengths (connect or answer).
READ_TIMEOUT_S = 2.0

#: Watchdogs running in this process (one per worker node), so a shutdown can mark them stopping.
_ACTIVE: list[StallWatchdog] = []


def heartbeat_interval(stall_timeout: float) -> float:
    """How often the heartbeat is rewritten and the queues are read: several times per STALL_TIMEOUT."""
    return min(5.0, max(0.5, stall_timeout / 4))


def mark_stopping(shutdown_timeout: float) -> None:
    """A soft shutdown blocks the event loop on purpose: tell the probe, for as long as it may last."""
    for watchdog in list(_ACTIVE):
        watchdog.write(STOPPING, "soft shutdown in progress", stale_after=shutdown_timeout + watchdog.timeout)
        watchdog.stopping = True


class _DepthReader(threading.Thread):
    """Counts the ready jobs of `queues` every `interval` seconds, off the event loop.

    While Redis cannot be read it calls `on_unreadable` each time: the consumer is then reconnecting, which
    Celery does outside the event loop (`celery/worker/consumer/consumer.py: Consumer.start` restarts the
    blueprint, whose `Connection` step blocks in `ensure_connected`), so the loop's heartbeat would go stale
    although nothing is stuck.
    """

    def __init__(self, interval: float, on_unreadable: Callable[[str], None]) -> None:
        super().__init__(name="pipeline-stall-reader", daemon=True)
        self.interval = interval
        self.on_unreadable = on_unreadable
        self.client = direct_redis(READ_TIMEOUT_S)
        self.queues: tuple[str, ...] = ()
        #: Ready jobs per queue at `read_at` (monotonic); None while Redis cannot be read.
        self.depths: dict[str, int] | None = None
        self.read_at = 0.0
        self.halt = threading.Event()

    def _lengths(self, queues: tuple[str, ...]) -> tuple[list[int], set[str]]:
        keys = [key for queue in queues for key in queue_keys(queue)]
        if self.client is None:  # Sentinel: the app's pool (it waits for Redis when it is down)
            with broker_redis() as client:
                return _llen(client, keys)
        return _llen(self.client, keys)

    def run(self) -> None:
        while not self.halt.is_set():
            queues = self.queues
            try:
                lengths, paused = self._lengths(queues)
                steps = len(lengths) // len(queues) if queues else 0  # one key per priority step
                self.depths = {
                    q: 0 if q in paused else sum(lengths[i * steps : (i + 1) * steps]) for i, q in enumerate(queues)
                }
                self.read_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001  # Redis down or failing over: nothing to judge until it is back
                self.depths = None
                self.on_unreadable(f"{type(exc).__name__}: {exc}")
            self.on_cycle()
            self.halt.wait(self.interval)

    def on_cycle(self) -> None:
        """Called after every read (the watchdog's `keepalive`)."""


def _llen(client: redis.Redis, keys: list[str]) -> tuple[list[int], set[str]]:
    """LLEN of each key, and the paused queues (`pipeline.scheduling.pause`): their jobs wait by design, no stall."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    pipe.smembers(PAUSED_KEY)
    *lengths, paused = pipe.execute()
    return [int(n) for n in lengths], {bytes_to_str(queue) for queue in paused}


def _can_consume(consumer: Any) -> tuple[bool, str]:
    """Whether the consumer would take another message now, and a note when it has no broker connection."""
    task_consumer = getattr(consumer, "task_consumer", None)
    if task_consumer is None:
        return True, " (the consumer has no broker connection)"
    try:
        return bool(task_consumer.channel.qos.can_consume()), ""
    except Exception:  # noqa: BLE001  # a channel torn down under us: it holds nothing, so it has room
        return True, " (the consumer's channel is closed)"


class StallWatchdog(bootsteps.StartStopStep):
    """Writes the node's heartbeat from the event loop and marks it stalled when queued jobs are not fetched."""

    # After the pool: its reader thread connects at once, and a prefork child forked while that thread is inside
    # OpenSSL (a rediss:// broker: the TLS context and handshake) inherits OpenSSL's locks held, so the child's
    # own first TLS connection (storing a result) waits on them forever. Started after the pool's children are
    # forked, the thread cannot race the fork. (Without the requirement the bootstep graph put it on either side.)
    requires = ("celery.worker.components:Hub", "celery.worker.components:Pool")

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.enabled = bool(getattr(parent, "use_eventloop", False))
        settings = get_settings()
        self.timeout = settings.stall_timeout
        self.interval = heartbeat_interval(self.timeout)
        self.path: Path = health_path(settings.worker_health_dir, str(getattr(parent, "hostname", "celery")))
        self.worker = parent
        self.expected: set[str] = set()
        self.last_fetch = time.monotonic()
        self.blocked_since: float | None = None
        self.state = OK
        self.stopping = False
        self.reader = _DepthReader(self.interval, self._broker_unreadable)
        self.reader.on_cycle = self.keepalive  # type: ignore[method-assign]  # the reader's hook
        #: While a job runs on the event loop (solo pool): monotonic time past which it has overrun its limits.
        self.busy_until: float | None = None
        self._write_failed = False

    def start(self, parent: Any) -> None:
        # The queues the worker was started for (-Q), before any `cancel_consumer` deselects one.
        self.expected = set(parent.app.amqp.queues.consume_from)
        self.reader.queues = tuple(sorted(self.expected))
        self._count_fetches(parent.consumer)
        _ACTIVE.append(self)
        self.write(OK, None)
        self.reader.start()
        parent.hub.call_repeatedly(self.interval, self.tick)
        logger.info(
            "stall watchdog: heartbeat in %s every %.1f s (STALL_TIMEOUT=%ss)", self.path, self.interval, self.timeout
        )

    def stop(self, parent: Any) -> None:
        self.reader.halt.set()
        if self.reader.client is not None:
            self.reader.client.close()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        # A worker that stopped has no heartbeat (a probe of the next one must not read this one's file).
        with contextlib.suppress(OSError):
            self.path.unlink()

    def terminate(self, parent: Any) -> None:
        # A cold shutdown terminates steps instead of stopping them (`celery/bootsteps.py: StartStopStep.terminate`).
        self.stop(parent)

    def _broker_unreadable(self, error: str) -> None:
        """From the reader thread: Redis is down, the worker waits for it (alive, not stalled)."""
        if not self.stopping:
            self.state = OK
            self.blocked_since = None
            self.write(OK, f"broker unreadable, waiting for it: {error[:200]}")

    def keepalive(self) -> None:
        """From the reader thread: a job on the event loop (solo pool) keeps the heartbeat fresh until it overruns."""
        busy_until = self.busy_until
        if busy_until is not None and not self.stopping and time.monotonic() < busy_until:
            self.write(OK, "running a job on the event loop (solo pool)")

    def _count_fetches(self, consumer: Any) -> None:
        """Record the time of every fetched message, before the consumer's own handler sees it."""
        create = consumer.create_task_handler

        def create_task_handler(*args: Any, **kwargs: Any) -> Any:
            handle = create(*args, **kwargs)

            def on_task_received(message: Any) -> Any:
                self.last_fetch = time.monotonic()
                return handle(message)

            return on_task_received

        consumer.create_task_handler = create_task_handler

    def write(self, state: str, reason: str | None, stale_after: float | None = None) -> None:
        try:
            write_heartbeat(self.path, state, reason, stale_after or self.timeout, node=self.worker.hostname)
            self._write_failed = False
        except OSError as exc:
            if not self._write_failed:
                logger.error("stall watchdog: cannot write the heartbeat file %s: %s", self.path, exc)
            self._write_failed = True

    def _consumed(self) -> set[str]:
        task_consumer = getattr(self.worker.consumer, "task_consumer", None)
        return {q.name for q in getattr(task_consumer, "queues", None) or ()}

    def tick(self) -> None:
        if self.stopping:
            return
        now = time.monotonic()
        self.reader.queues = tuple(sorted(self.expected | self._consumed()))
        depths, read_at = self.reader.depths, self.reader.read_at
        fresh = depths is not None and now - read_at <= 3 * self.interval and read_at > self.last_fetch
        ready = {q: n for q, n in (depths or {}).items() if n > 0} if fresh else {}
        room, note = _can_consume(self.worker.consumer)
        if not (ready and room):
            self.blocked_since = None
        elif self.blocked_since is None or self.last_fetch > self.blocked_since:
            self.blocked_since = now
        waited = now - self.blocked_since if self.blocked_since is not None else 0.0
        if waited >= self.timeout:
            jobs = ", ".join(f"{n} in {q}" for q, n in sorted(ready.items()))
            reason = (
                f"queued jobs not fetched: {jobs} ready for {waited:.0f} s while this worker had room for more and"
                f" fetched nothing (not consuming{note}; STALL_TIMEOUT={self.timeout:g}s)"
            )
            if self.state != STALLED:
                logger.warning("worker stalled: %s", reason)
            self.state = STALLED
            self.write(STALLED, reason)
            return
        if self.state == STALLED:
            logger.warning("worker consuming again: the stall is over")
        self.state = OK
        self.write(OK, None)


class RunningJob:
    """The guard around a job that runs on the event loop (`pipeline.task.GUARDS`, solo workers): see `keepalive`."""

    def start(self, task: Any) -> None:
        busy = time.monotonic() + (timelimits.limits(task)[1] or float("inf"))
        for watchdog in list(_ACTIVE):
            watchdog.busy_until = busy + watchdog.timeout

    def stop(self) -> None:
        for watchdog in list(_ACTIVE):
            watchdog.busy_until = None


running_job = RunningJob()
