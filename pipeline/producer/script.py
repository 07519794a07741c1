"""The one Redis call that stores jobs due now: records, recent-jobs index, messages, events, and the claim of
an idempotency key, atomically (a Lua script: one command, one reply).

Each job also pushes a wake-up marker on its queue (`pipeline.queues.wake`): an idle worker of it wakes at once.

A MULTI of the same commands is one round trip too, but answers once per command; the script answers once.
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
from pipeline.constants import GROUP_KEY_PREFIX, JOB_RECORD_KEY
from pipeline.queues import keys as layout
from pipeline.queues import wake


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
    call. With `claim` (idempotency key, ttl) and a single job: None if the key was free (now held by the job),
    else the id holding it, and nothing is written. `NotReplicated` when REDIS_WAIT_REPLICAS replicas did not
    confirm the jobs (or the claimed key's job) in time; `BrokerFull` when Redis is at maxmemory. With `group`, the
    messages go on that group's list of `dest` instead (the messages must carry the group's header too)."""
    claim_key, claim_ttl = claim if claim is not None else (dest, "")
    keys = (layout.recent(queue), dest, claim_key, wake.marker(dest))  # one marker per job
    head = (JOB_RECORD_KEY.format(id=""), record, record_ttl, repr(now), get_settings().recent_jobs_max)
    grouped = (group or "", GROUP_KEY_PREFIX)  # a group's jobs go on its own list (`pipeline/lua/enqueue.lua`)
    args: tuple[str | int, ...] = (*head, len(ids), channel, claim_ttl, *grouped, *ids, *messages, *events)
    try:
        reply, reached = run_script_waited(client, "enqueue", keys, args, barrier=claim is not None)
    except redis.RedisError as exc:
        if is_oom(exc):
            raise full(exc) from exc
        raise
    if reached is not None:
        check_replicas(reached)
    if isinstance(reply, bytes):
        return reply.decode()
    return reply if isinstance(reply, str) else None
