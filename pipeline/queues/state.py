"""Reads of what the queues' own keys say, in either layout (`pipeline.queues.keys`): which queues are paused, which
jobs are delivered and not acknowledged, which are parked until due.

On a single Redis these are kombu's and the pipeline's shared keys (the `unacked` hash, the `pipeline:paused` set,
`pipeline:delayed`), read once for every queue. On a Redis Cluster each queue has its own (in its hash tag's slot),
so each is read per queue, in one pipeline without MULTI: a cluster client splits it by master. Every read names
its keys: nothing here scans a node or reads a key of one queue's slot for another queue.

`client` is a redis-py client on the broker: `redis.Redis`, or `redis.cluster.RedisCluster` on a cluster URL.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kombu.utils.encoding import bytes_to_str

from pipeline.constants import PAUSED_KEY, PRIORITY_SEPARATOR
from pipeline.queues import keys


def paused(client: Any, queues: Iterable[str]) -> set[str]:
    """Which of `queues` are paused: members of the paused set, or on a cluster those whose own flag is set."""
    queues = list(queues)
    if not keys.clustered():
        members = {bytes_to_str(member) for member in client.smembers(PAUSED_KEY)}
        return {queue for queue in queues if queue in members}
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.exists(keys.paused(queue))
    return {queue for queue, flagged in zip(queues, pipe.execute(), strict=True) if flagged}


def delivered(client: Any, queues: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """(queue, kombu envelope) of every job of `queues` delivered to a worker and not acknowledged (running or
    prefetched): kombu's delivery records hold `[message, exchange, routing key]` per delivery tag."""
    queues = list(queues)
    if keys.clustered():
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            pipe.hvals(keys.unacked(queue))
        records = [value for values in pipe.execute() for value in values]
    else:
        records = client.hvals(keys.unacked(queues[0], cluster=False)) if queues else []
    found = []
    for value in records:
        try:
            message, _, routing_key = json.loads(value)
        except (ValueError, TypeError):
            continue
        if isinstance(message, dict) and str(routing_key) in queues:
            found.append((str(routing_key), message))
    return found


def in_flight(client: Any, queues: Iterable[str]) -> dict[str, int]:
    """Delivered-but-unacknowledged jobs per queue of `queues` (`delivered`), 0 for a queue with none."""
    queues = list(queues)
    counts = dict.fromkeys(queues, 0)
    if keys.clustered():  # each queue's own record: its length is the count
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            pipe.hlen(keys.unacked(queue))
        return {queue: int(n) for queue, n in zip(queues, pipe.execute(), strict=True)}
    for queue, _ in delivered(client, queues):
        counts[queue] += 1
    return counts


def parked_queues(client: Any, queues: Iterable[str]) -> list[str]:
    """The queue of each job parked until it is due (`pipeline:delayed`, the destination of each), once per job."""
    queues = list(queues)
    if not keys.clustered():
        dests = client.hvals(keys.delayed(queues[0], cluster=False)[2]) if queues else []
        return [bytes_to_str(dest).split(PRIORITY_SEPARATOR, 1)[0] for dest in dests]
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.zcard(keys.delayed(queue)[0])
    return [queue for queue, n in zip(queues, pipe.execute(), strict=True) for _ in range(int(n))]
