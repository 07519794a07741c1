"""The one Redis call that stores jobs due now: records, recent-jobs index, messages, events, and the claim of
an idempotency key, atomically (a Lua script: one command, one reply).

Each job also pushes a wake-up marker on its queue (`pipeline.queues.wake`): an idle worker of it wakes at once.

A MULTI of the same commands is one round trip too, but answers once per command; the script answers once.
On a Redis Cluster the script touches only the queue's keys (one slot): the job records, single keys of their own
slots, are written first in one pipeline (one batch per master); a record whose job was never stored (the producer
died between, or an idempotency key was claimed already: those records are deleted) reads as accepted and expires.

The script is `pipeline/lua/enqueue.lua` (its KEYS and ARGV layout are documented there), called through
`pipeline.lua.script`: it runs by SHA (EVALSHA) and is sent whole only when Redis does not know it yet (after a
restart or SCRIPT FLUSH).

With REDIS_WAIT_REPLICAS=N >= 1 the same round trip carries Redis's WAIT after the script, on its connection
(`pipeline.broker.run_script_waited`): the call returns once N replicas hold the jobs, else raises `NotReplicated`
(the jobs are on the primary and may survive, or be lost with it in a failover). A claimed idempotency key adds a
replication barrier before the WAIT, so a retry that finds the key answers with the first job's id only once that
job is replicated too. Redis at `maxmemory` refuses the script's first write (the claim, or the first record):
nothing is stored and `BrokerFull` is raised (`pipeline.broker.full`).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pipeline.broker import check_replicas, full, is_oom, run_script_waited
from pipeline.config import get_settings
from pipeline.constants import JOB_RECORD_KEY
from pipeline.queues import jobkeys
from pipeline.queues import keys as layout


def store_jobs(
    client: redis.Redis,
    *,
    queue: str,
    dest: str,
    record: str,
    record_ttl: int,
    now: float,
    ids: Sequence[str],
    messages: Sequence[str],
    channel: str = "",
    events: Sequence[str] = (),
    claim: tuple[str, int] | None = None,
    group: str | None = None,
) -> str | None:
    """Store jobs `ids` (their `messages` LPUSHed on `dest` in order, `events` PUBLISHed on `channel`), in one
    call. With `claim` (idempotency key, ttl): None if the key was free (now held by the first job), else the id
    holding it, and nothing is written (on a cluster the records written first are deleted, unless that id is the
    first job's: a flow's step enqueued again with its own ids, `pipeline.flows.handoff`). `NotReplicated` when
    REDIS_WAIT_REPLICAS replicas did not confirm the jobs (or the claimed key's job) in time; `BrokerFull` when Redis
    is at maxmemory. With `group`, the messages go on that group's list of `dest` instead (the messages must carry
    the group's header too)."""
    claim_key, claim_ttl = claim if claim is not None else (dest, "")
    clustered = layout.clustered()
    keys = [layout.recent(queue, clustered), dest, claim_key, layout.wake(layout.queue_of(dest, clustered), clustered)]
    if group:  # a group's jobs go on its own list (`pipeline/lua/enqueue.lua`)
        keys += [layout.group_jobs(queue, dest, group, clustered), layout.group_ring(queue, dest, clustered)]
        keys += [layout.group_state(queue, dest, clustered), layout.group_count(queue, clustered)]
    if clustered:  # the records are not the queue's keys: written first, each in its own slot
        _write_records(client, ids, record, record_ttl)
    prefix = "" if clustered else JOB_RECORD_KEY.format(id="")
    head = (prefix, record, record_ttl, repr(now), get_settings().recent_jobs_max)
    args: tuple[str | int, ...] = (*head, len(ids), channel, claim_ttl, group or "", *ids, *messages, *events)
    try:
        reply, reached = run_script_waited(client, "enqueue", keys, args, barrier=claim is not None)
    except redis.RedisError as exc:
        if is_oom(exc):
            raise full(exc) from exc
        raise
    if reached is not None:
        check_replicas(reached)
    if isinstance(reply, bytes):
        reply = reply.decode()
    if not isinstance(reply, str):
        return None
    if clustered and reply != ids[0]:  # the key was claimed before: the records written for this call name no job
        client.delete(*[jobkeys.record(task_id) for task_id in ids])
    return reply


def _write_records(client: redis.Redis, ids: Sequence[str], record: str, ttl: int) -> None:
    """Write the job records of `ids` in one pipeline (a cluster client sends one batch per master); Redis at
    maxmemory: `BrokerFull`, and no job is stored."""
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.set(jobkeys.record(task_id), record, ex=ttl)
    try:
        pipe.execute()
    except redis.RedisError as exc:
        if is_oom(exc):
            raise full(exc) from exc
        raise
