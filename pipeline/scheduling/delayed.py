"""Releasing parked delayed jobs (`pipeline.publish.schedule` parks them) onto their queues when due.

On a Redis Cluster each work queue parks its jobs in delayed keys of its own slot (`pipeline.queues.keys.delayed`)
and a release is one script call per queue.

One Lua script (`pipeline/lua/delayed_release.lua`) moves every entry due within DELAYED_RELEASE_AHEAD seconds onto
its queue (LPUSH, as kombu does) and deletes it, atomically: an entry is released exactly once even when many
releasers run, and a crash cannot lose or duplicate one. Every worker main process and every beat runs a releaser
thread (`Releaser`) polling each DELAYED_POLL_INTERVAL seconds, so there is no single point of failure and no leader
to elect. A poll first reads the earliest due time (one ZRANGE, in the round trip that reads Redis's clock on a
single Redis) and calls the script only when an entry is due, so an idle releaser costs Redis one round trip per
poll. A parked job's due time is its ETA, from the producer's clock (as
Celery's ETA is); releasers judge it on Redis's clock (TIME), so releasers on hosts whose clocks disagree release it
at the same moment. Released jobs keep their ETA, so the worker's timer starts them at the due time; a worker holds
a released job at most DELAYED_RELEASE_AHEAD seconds before it is due (`Settings.release_ahead`), renewing its lease
meanwhile. Each release pushes a wake-up marker on its queue (`pipeline.queues.wake`), so an idle worker of the
queue starts the job at once.

With REDIS_WAIT_REPLICAS=N >= 1 the release carries Redis's WAIT in its round trip (`run_script_waited`). A
release that N replicas do not confirm in time is logged and left as it is: it is already whole on the primary,
and the script's effects replicate as one block, so a replica holds either the release or the parked entry,
never both and never neither. If a failover loses the release, the new primary still has the job parked and a
releaser releases it again: nothing is lost or doubled, it only runs up to a poll interval later.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import redis

from pipeline.broker import broker_redis, replicas_wanted, run_script_waited
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY
from pipeline.queues import keys as layout
from pipeline.queues.routed import routed_queues
from pipeline.queues.wake import WAKE_KEY

log = logging.getLogger(__name__)


def release_due(now: float | None = None, limit: int = 500) -> int:
    """Move up to `limit` jobs due within DELAYED_RELEASE_AHEAD onto their queues; return how many (a release
    fewer than REDIS_WAIT_REPLICAS replicas confirmed is logged, not undone: see the module docstring)."""
    released = 0
    with broker_redis() as client:
        calls, earliest = _calls(), None
        if now is None:  # Redis's clock: every releaser, on every host, judges a due time on the same one
            now, earliest = _clock(client, calls)
        horizon = now + get_settings().release_ahead
        args = [horizon, limit, WAKE_KEY.format(queue="")]  # each release wakes its queue's idle workers
        for keys in calls:
            if not _due(earliest if earliest is not None else _earliest(client, keys[0]), horizon):
                continue  # nothing parked is due: no script call (most polls of an idle worker)
            moved, reached = run_script_waited(client, "delayed_release", keys, args)
            released += int(moved)
            _check(int(moved), reached)
    return released


def _clock(client: redis.Redis, calls: list[list[str]]) -> tuple[float, list[Any] | None]:
    """Redis's clock (seconds), and on a single Redis (one call) the earliest entry of its due-time index, read in
    the same round trip: an idle releaser's poll is one round trip. None on a cluster (each queue's index is read on
    its own master)."""
    if len(calls) != 1 or layout.clustered():
        seconds, micros = client.time()
        return float(seconds) + float(micros) / 1e6, None
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrange(calls[0][0], 0, 0, withscores=True)
    (seconds, micros), earliest = pipe.execute()
    return float(seconds) + float(micros) / 1e6, earliest


def _earliest(client: redis.Redis, index: str) -> list[Any]:
    """The earliest entry of the due-time index `index`, with its score: a read of one entry."""
    return list(client.zrange(index, 0, 0, withscores=True))


def _due(earliest: list[Any], horizon: float) -> bool:
    """Whether that earliest entry is due by `horizon`: a poll that finds nothing due costs Redis a ZRANGE, not a
    script call. An entry parked after this read is released by the next poll, as one parked just after a release
    is."""
    return bool(earliest) and float(earliest[0][1]) <= horizon


def _calls() -> list[list[str]]:
    """The KEYS of each release call: on a single Redis one call over the shared keys; on a cluster one per queue the
    app routes to (`pipeline.queues.routed`: a task's own queue too), with its delayed keys and its marker list (its
    slot)."""
    if not layout.clustered():
        return [[DELAYED_KEY, DELAYED_MESSAGE_KEY, DELAYED_DEST_KEY]]
    return [[*layout.delayed(queue), layout.wake(queue)] for queue in routed_queues(get_app())]


def _check(released: int, reached: int | None) -> None:
    """Log a release fewer than REDIS_WAIT_REPLICAS replicas confirmed (see the module docstring)."""
    if released and reached is not None and reached < replicas_wanted():
        log.warning(
            "released %d delayed job(s); only %d of %d replica(s) confirmed it within %d ms (REDIS_WAIT_REPLICAS): "
            "a failover now would park them again, to be released once more",
            released,
            reached,
            replicas_wanted(),
            get_settings().redis_wait_timeout_ms,
        )


class Releaser:
    """A daemon thread calling `release_due` every DELAYED_POLL_INTERVAL seconds until `stop()`."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-delayed-releaser", daemon=True)

    def start(self) -> Releaser:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        interval = get_settings().delayed_poll_interval
        while not self._stop.is_set():
            if _chore("releasing delayed jobs", release_due, interval) >= 500:
                continue  # a backlog: keep draining without waiting
            for name, chore in CHORES:
                _chore(name, chore, interval)
            self._stop.wait(interval)


def _chore(name: str, chore: Callable[[], int], interval: float) -> int:
    """`chore()`, its failure logged: Redis down or failing over (what it works on is safe in Redis), or a bug (the
    thread must outlive it too)."""
    try:
        return chore()
    except (redis.RedisError, OSError) as exc:
        log.warning("%s failed, retrying in %ss: %r", name, interval, exc)
    except Exception:
        log.exception("%s failed; retrying", name)
    return 0


#: What else the releaser's loop does each round, after releasing: (what it does, for the log; the call). A layer
#: above adds its own (the flows' reconciler on a Redis Cluster: `pipeline.runtime.signals`).
CHORES: list[tuple[str, Callable[[], int]]] = []


_releaser: Releaser | None = None


def start_releaser() -> None:
    """Start this process's releaser once (worker main process, beat)."""
    global _releaser
    if _releaser is None:
        _releaser = Releaser().start()


def stop_releaser() -> None:
    global _releaser
    if _releaser is not None:
        _releaser.stop()
        _releaser = None


@contextlib.contextmanager
def releasing() -> Iterator[None]:
    """A releaser for the duration of a block (tests, one-off scripts)."""
    start_releaser()
    try:
        yield
    finally:
        stop_releaser()
