"""The one Redis call that stores jobs due now: records, recent-jobs index, messages, events, and the claim of
an idempotency key, atomically (a Lua script: one command, one reply).

A MULTI of the same commands is one round trip too, but answers once per command; the script answers once.
The script is `pipeline/lua/enqueue.lua` (its KEYS and ARGV layout are documented there), called through
`pipeline.lua.script`: it runs by SHA (EVALSHA) and is sent whole only when Redis does not know it yet (after a
restart or SCRIPT FLUSH).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pipeline.config import get_settings
from pipeline.constants import JOB_RECORD_KEY, RECENT_JOBS_KEY
from pipeline.lua import script


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
) -> str | None:
    """Store jobs `ids` (their `messages` LPUSHed on `dest` in order, `events` PUBLISHed on `channel`), in one
    call. With `claim` (idempotency key, ttl) and a single job: None if the key was free (now held by the job),
    else the id holding it, and nothing is written."""
    claim_key, claim_ttl = claim if claim is not None else (dest, "")
    keys = (RECENT_JOBS_KEY.format(queue=queue), dest, claim_key)
    head = (JOB_RECORD_KEY.format(id=""), record, record_ttl, repr(now), get_settings().recent_jobs_max)
    args: tuple[str | int, ...] = (*head, len(ids), channel, claim_ttl, *ids, *messages, *events)
    reply = script("enqueue")(keys=keys, args=args, client=client)
    if isinstance(reply, bytes):
        return reply.decode()
    return reply if isinstance(reply, str) else None
