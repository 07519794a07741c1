"""Paused queues: a queue named in the Redis set `pipeline:paused` keeps accepting jobs, and no worker starts one.

The set is read inside the worker's fetch (`fetch.lua`), in the same atomic step that pops jobs, so a job of a
paused queue is never taken from Redis; every worker sees a pause at its next fetch. Jobs a worker fetched before
the pause landed and has not started yet (a solo worker's batch, up to its prefetch) are checked again before each
starts (`pipeline.delivery.fetch`) and put back at the head of their queue. Running jobs finish. `resume` pushes
the queue's wake-up marker, so idle workers fetch its jobs at once (`pipeline.delivery.waking`: an idle worker
never waits on a paused queue's markers, and fetches at least every WAKE_POLL_S anyway).

On a Redis Cluster a queue's pause is a flag of its own in its slot, `pipeline:{<queue>}:paused` (a string, set
while paused: `pipeline.queues.keys.paused`), which the queue's fetch reads in the same slot.

Only the queues the app routes to can be paused (`pipeline.queues.routed.job_queues`: the work queues, ROUTES, each
task's own queue, the queues the app declares or consumes): the dead-letter queue has no consumer (its entries move
only when an operator replays them) and Celery's own queues (control, replies) must keep flowing for workers to be
operable.
"""

from __future__ import annotations

from pipeline.broker import broker_redis, confirm_replicated, memory_refusals
from pipeline.celery_app import get_app
from pipeline.constants import DEAD_LETTER_QUEUE, PAUSED_KEY
from pipeline.queues import keys, wake
from pipeline.queues.routed import UnknownQueue, known_queue

__all__ = ["NotPausable", "UnknownQueue", "check_pausable", "is_paused", "pause", "resume"]


class NotPausable(ValueError):
    """A queue that exists but that no worker consumes jobs from (the dead-letter queue)."""


def check_pausable(queue: str) -> str:
    """`queue` if the app routes to it; else `NotPausable` (the dead-letter queue) or `UnknownQueue`."""
    if queue == DEAD_LETTER_QUEUE:
        raise NotPausable(
            f"{queue} has no consumer to pause: its entries run again only when replayed (`pipeline dlq replay`)"
        )
    return known_queue(get_app(), queue)


def pause(queue: str) -> bool:
    """Pause `queue` (a queue the app routes to, `check_pausable`); True if it was running until now."""
    check_pausable(queue)
    with broker_redis() as client, memory_refusals():
        if keys.clustered():
            added = 0 if client.set(keys.paused(queue), "1", get=True) else 1
        else:
            added = int(client.sadd(PAUSED_KEY, queue))
        confirm_replicated(client, keys.paused(queue))  # a pause lost in a failover would let its jobs start
    return added == 1


def is_paused(queue: str) -> bool:
    """Whether `queue` is paused now (a member of the set on a single Redis, its flag on a cluster)."""
    with broker_redis() as client:
        if keys.clustered():
            return bool(client.exists(keys.paused(queue)))
        return bool(client.sismember(PAUSED_KEY, queue))


def resume(queue: str) -> bool:
    """Resume `queue` (a queue the app routes to, `check_pausable`); True if it was paused until now."""
    check_pausable(queue)
    with broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        if keys.clustered():  # the flag and the marker list share the queue's slot
            pipe.delete(keys.paused(queue))
        else:
            pipe.srem(PAUSED_KEY, queue)
        wake.mark(pipe, queue)  # an idle worker of the queue wakes now, not at its next poll
        removed = int(pipe.execute()[0])
        confirm_replicated(client, keys.paused(queue))
    return removed == 1
