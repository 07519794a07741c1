"""Delayed jobs that outlive the visibility timeout: parked in Redis, released to their queue when due.

On a Redis broker Celery hands a countdown/ETA job to a worker at once; the worker holds it in memory
and Redis redelivers it every visibility timeout until it runs (so a long delay runs many times, and a
flood of delayed jobs fills worker memory). Here a job due later than DELAYED_RELEASE_AHEAD seconds is
never given to a worker early:

* **Park.** The exact message Celery would publish (kombu's Redis envelope, ETA included) is captured
  instead of sent, and stored under its task id: ZSET ``pipeline:delayed`` (score = due time) plus two
  hashes (envelope, destination list key), written in one MULTI.
* **Release.** One Lua script moves every entry due within DELAYED_RELEASE_AHEAD seconds onto its queue
  (LPUSH, as kombu does) and deletes it, atomically: an entry is released exactly once even when many
  releasers run, and a crash cannot lose or duplicate one. Every worker main process and every beat runs
  a releaser thread (`Releaser`) polling each DELAYED_POLL_INTERVAL seconds, so there is no single point
  of failure and no leader to elect.
* **On time.** Released jobs keep their ETA, so the worker's timer starts them at the due time; a
  worker holds a job at most DELAYED_RELEASE_AHEAD seconds (capped at half of what the visibility
  timeout leaves after the longest time limit, `Settings.release_ahead`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery.result import denied_join_result
from kombu import Producer

from pipeline.app import app
from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY

log = logging.getLogger(__name__)

#: Sends the job through `producer` (None: the app's pool) with this ETA.
Send = Callable[[Producer | None, datetime | None], Any]

_RELEASE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local released = 0
for _, id in ipairs(due) do
  local dest = redis.call('HGET', KEYS[3], id)
  local body = redis.call('HGET', KEYS[2], id)
  if dest and body then
    redis.call('LPUSH', dest, body)
    released = released + 1
  end
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
return released
"""


@dataclass
class _Recorder:
    """Stands in for a kombu publish batch: the Redis transport routes the message and hands this object
    its final Redis commands (``add("lpush", key, envelope)``), which are recorded instead of sent."""

    commands: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def publish(self, channel: Any, message: Any, **kwargs: Any) -> None:
        channel.basic_publish(message, _publish_batch=self, **kwargs)

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))


@dataclass(frozen=True)
class Captured:
    #: The queue's Redis list key and kombu's envelope, as kombu would LPUSH them.
    dest: str
    body: str
    #: Other commands of the publish (the `task-sent` event's PUBLISH), run when the job is parked.
    extra: tuple[tuple[str, tuple[Any, ...]], ...]


def capture(send: Callable[[Producer], Any]) -> Captured:
    """What `send(producer)` would write to Redis, recorded without publishing it."""
    return capture_many([send])[0]


def capture_many(sends: Iterable[Callable[[Producer], Any]]) -> list[Captured]:
    """Record what each `send(producer)` would write to Redis, on one producer, publishing nothing.

    Uses kombu 5.7's batch hook on the producer (the per-thread slot `Producer.batch()` fills), so each
    envelope is byte for byte kombu's own: routing, priority, serialization and body encoding included.
    """
    captured = []
    # Celery's Redis result backend subscribes to each new task's result channel when it is sent (two
    # round trips per job); a recorded message is not sent yet, and `result()` fetches stored results.
    with denied_join_result(), app.producer_or_acquire() as producer:
        slot = producer._batch_local
        previous = getattr(slot, "current", None)
        try:
            for send in sends:
                recorder = slot.current = _Recorder()
                send(producer)
                captured.append(_one_message(recorder.commands))
        finally:
            slot.current = previous
            if previous is None:
                del slot.current
    return captured


def _one_message(commands: list[tuple[str, tuple[Any, ...]]]) -> Captured:
    pushes = [args for name, args in commands if name == "lpush"]
    extra = tuple((name, args) for name, args in commands if name != "lpush")
    if len(pushes) != 1 or any(name != "publish" for name, _ in extra):
        raise RuntimeError(f"a job must route to exactly one Redis queue, got {commands!r}")
    key, body = pushes[0]
    return Captured(str(key), body.decode() if isinstance(body, bytes) else str(body), extra)


def schedule(send: Send, task_id: str, due: float | None) -> bool:
    """Publish now (or with a short ETA) when `due` is near, else park; True when parked."""
    if due is None or due - time.time() <= get_settings().release_ahead:
        send(None, _eta(due) if due is not None and due > time.time() else None)
        return False
    message = capture(lambda producer: send(producer, _eta(due)))
    with broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        pipe.hset(DELAYED_MESSAGE_KEY, task_id, message.body)
        pipe.hset(DELAYED_DEST_KEY, task_id, message.dest)
        pipe.zadd(DELAYED_KEY, {task_id: due})
        for _, args in message.extra:
            pipe.publish(*args)
        pipe.execute()
    return True


def _eta(due: float) -> datetime:
    return datetime.fromtimestamp(due, UTC)


def parked_due(task_id: str) -> float | None:
    """When a parked job is due (epoch seconds), or None if it is not parked."""
    with broker_redis() as client:
        score = client.zscore(DELAYED_KEY, task_id)
    return None if score is None else float(score)


def is_parked(task_id: str) -> bool:
    return parked_due(task_id) is not None


def parked_count() -> int:
    with broker_redis() as client:
        return int(client.zcard(DELAYED_KEY))


def release_due(now: float | None = None, limit: int = 500) -> int:
    """Move up to `limit` jobs due within DELAYED_RELEASE_AHEAD onto their queues; return how many."""
    horizon = (time.time() if now is None else now) + get_settings().release_ahead
    with broker_redis() as client:
        released = client.eval(_RELEASE, 3, DELAYED_KEY, DELAYED_MESSAGE_KEY, DELAYED_DEST_KEY, horizon, limit)
    return int(released)


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
            try:
                if release_due() >= 500:
                    continue  # a backlog: keep draining without waiting
            except Exception:  # Redis down or failing over: keep trying, the entries are safe in Redis
                log.warning("releasing delayed jobs failed; retrying", exc_info=True)
            self._stop.wait(interval)


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
