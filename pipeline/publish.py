"""Publishing a job now, or parked in Redis until it is due; capturing the exact message Celery would send.

On a Redis broker Celery hands a countdown/ETA job to a worker at once; the worker holds it in memory
and Redis redelivers it every visibility timeout until it runs (so a long delay runs many times, and a
flood of delayed jobs fills worker memory). Here a job due later than DELAYED_RELEASE_AHEAD seconds is
never given to a worker early:

* **Park** (`schedule`, for retries and the rate limiter; `TypedTask.enqueue` parks through
  `pipeline.producer`, with the job record in the same MULTI). The exact message Celery would publish
  (kombu's Redis envelope, ETA included) is captured instead of sent, and stored under its task id: ZSET
  ``pipeline:delayed`` (score = due time) plus two hashes (envelope, destination list key), written in one
  MULTI. `pipeline.scheduling.delayed`
  releases it to its queue when due, exactly once.
* **Capture** (`capture`, `capture_many`). What Celery would write to Redis for a publish, recorded instead
  of sent (through kombu's batch hook: `pipeline.compat.batch`): parking uses it, and so does
  `pipeline.producer`, which writes typed jobs (and their records) in one round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery.result import denied_join_result
from kombu import Producer

from pipeline.broker import broker_redis
from pipeline.celery_app import get_app
from pipeline.compat import batch
from pipeline.compat.batch import Command
from pipeline.config import get_settings
from pipeline.constants import DELAYED_KEY
from pipeline.queues import keys
from pipeline.queues.routed import routed_queues

#: Sends the job through `producer` (None: the app's pool) with this ETA.
Send = Callable[[Producer | None, datetime | None], Any]


def due_time(countdown: float | None, eta: datetime | None) -> float | None:
    """Epoch seconds a job is due, from a countdown or an ETA (naive ETAs are UTC); None: now."""
    if eta is not None:
        return (eta if eta.tzinfo else eta.replace(tzinfo=UTC)).timestamp()
    if countdown is not None and countdown > 0:
        return time.time() + countdown
    return None


@dataclass(frozen=True)
class Captured:
    #: The queue's Redis list key and kombu's envelope, as kombu would LPUSH them.
    dest: str
    body: str
    #: Other commands of the publish (the `task-sent` event's PUBLISH), run when the job is parked.
    extra: tuple[tuple[str, tuple[Any, ...]], ...]


def declare_option() -> dict[str, Any]:
    """Celery's publish option that declares nothing, on a Redis Cluster (kombu's declare reads the queue's lists on
    the one node Celery is given, whichever slots it serves); none on a single Redis."""
    return {"declare": []} if keys.clustered() else {}


def capture(send: Callable[[Producer], Any]) -> Captured:
    """What `send(producer)` would write to Redis, recorded without publishing it."""
    return capture_many([send])[0]


def capture_many(sends: Iterable[Callable[[Producer], Any]]) -> list[Captured]:
    """Record what each `send(producer)` would write to Redis, on one producer, publishing nothing: each
    envelope byte for byte kombu's own (`pipeline.compat.batch.record`)."""
    # Celery's Redis result backend subscribes to each new task's result channel when it is sent (two
    # round trips per job); a recorded message is not sent yet, and `result()` fetches stored results.
    with denied_join_result(), get_app().producer_or_acquire() as producer:
        return [_one_message(commands) for commands in batch.record(producer, sends)]


def _one_message(commands: list[Command]) -> Captured:
    pushes = [args for name, args in commands if name == "lpush"]
    extra = tuple((name, args) for name, args in commands if name != "lpush")
    if len(pushes) != 1 or any(name != "publish" for name, _ in extra):
        raise RuntimeError(f"a job must route to exactly one Redis queue, got {commands!r}")
    key, body = pushes[0]
    return Captured(keys.listed(str(key)), body.decode() if isinstance(body, bytes) else str(body), extra)


def schedule(send: Send, task_id: str, due: float | None) -> bool:
    """Publish now (or with a short ETA) when `due` is near, else park; True when parked."""
    if due is None or due - time.time() <= get_settings().release_ahead:
        send(None, _eta(due) if due is not None and due > time.time() else None)
        return False
    message = capture(lambda producer: send(producer, _eta(due)))
    with broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        park(pipe, task_id, message, due)
        pipe.execute()
        announce(client, message)
    return True


def park(pipe: Any, task_id: str, message: Captured, due: float) -> None:
    """Queue on `pipe` (a MULTI) the commands parking `message` under `task_id` until `due`: in the delayed keys of
    its queue (shared by every queue on a single Redis; the queue's slot on a cluster), with its extra PUBLISHes on a
    single Redis (`announce` sends them on a cluster, where a MULTI holds one slot's keys only)."""
    index, bodies, dests = keys.delayed(keys.queue_of(message.dest))
    pipe.hset(bodies, task_id, message.body)
    pipe.hset(dests, task_id, message.dest)
    pipe.zadd(index, {task_id: due})
    if not keys.clustered():
        for _, args in message.extra:
            pipe.publish(*args)


def announce(client: Any, message: Captured) -> None:
    """On a cluster, send `message`'s extra PUBLISHes (its `task-sent` event) after its MULTI; on a single Redis
    they went in it (`park`)."""
    if keys.clustered():
        for _, args in message.extra:
            client.publish(*args)


def _eta(due: float) -> datetime:
    return datetime.fromtimestamp(due, UTC)


def _indexes(queues: Iterable[str] = ()) -> list[str]:
    """The due-time indexes of parked jobs: one on a single Redis; on a cluster each queue's the app routes to
    (`pipeline.queues.routed`), and each of `queues` (those the jobs' records name, whatever this process routes)."""
    if not keys.clustered():
        return [DELAYED_KEY]
    return [keys.delayed(queue)[0] for queue in dict.fromkeys([*routed_queues(get_app()), *queues])]


def parked_due(task_id: str, queue: str | None = None) -> float | None:
    """When a parked job (of `queue`, if known) is due (epoch seconds), or None if it is not parked."""
    return parked_dues([task_id], [queue] if queue else ()).get(task_id)


def parked_dues(task_ids: list[str], queues: Iterable[str] = ()) -> dict[str, float]:
    """When each parked job of `task_ids` is due (epoch seconds; those not parked are left out), in one ZMSCORE per
    index (one round trip; on a cluster a batch per master), the indexes of `queues` (the jobs' own) read too."""
    if not task_ids:
        return {}
    with broker_redis() as client:
        pipe = client.pipeline(transaction=False)
        for index in _indexes(queues):
            pipe.zmscore(index, task_ids)
        found: dict[str, float] = {}
        for scores in pipe.execute():
            found.update(
                {task: float(score) for task, score in zip(task_ids, scores, strict=True) if score is not None}
            )
    return found


def is_parked(task_id: str) -> bool:
    return parked_due(task_id) is not None


@dataclass(frozen=True)
class ParkedStats:
    """Parked jobs (delayed, deferred by the rate limiter, long retries) and how late the most overdue is."""

    count: int
    #: Seconds since the earliest parked job was due (0 when none is): releasers move a job onto its
    #: queue DELAYED_RELEASE_AHEAD seconds before it is due, so anything above a few poll intervals means
    #: no worker or beat is releasing.
    overdue_s: float


def parked_stats(now: float | None = None) -> ParkedStats:
    """Count the parked jobs and measure the most overdue one, in one round trip (no MULTI: Redis at maxmemory
    refuses one, reads included, and the exporter must read a full broker)."""
    with broker_redis() as client:
        pipe = client.pipeline(transaction=False)
        for index in _indexes():
            pipe.zcard(index)
            pipe.zrange(index, 0, 0, withscores=True)
        replies = pipe.execute()
    count = sum(int(n) for n in replies[::2])
    dues = [float(first[0][1]) for first in replies[1::2] if first]
    now = time.time() if now is None else now
    overdue = max(0.0, now - min(dues)) if dues else 0.0
    return ParkedStats(count, overdue)
