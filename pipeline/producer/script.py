"""The one Redis call that stores jobs due now: records, recent-jobs index, messages, events, and the claim of
an idempotency key, atomically (a Lua script: one command, one reply).

A MULTI of the same commands is one round trip too, but answers once per command; the script answers once.
It runs by SHA (EVALSHA) and is sent whole only when Redis does not know it yet (after a restart or
SCRIPT FLUSH).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import redis
from redis.exceptions import NoScriptError

from pipeline.config import get_settings
from pipeline.constants import JOB_RECORD_KEY, RECENT_JOBS_KEY

#: KEYS: recent-jobs index, queue list, idempotency key (or any key, unused, when there is no claim).
#: ARGV: record key prefix, record, record ttl, now, index size, job count n, event channel ('' for none),
#: claim ttl ('' for no claim), then n ids, n messages, and n events when there is a channel.
#: Returns n, or the id already holding the idempotency key (and writes nothing).
SOURCE = """
local prefix, record, ttl, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local keep, n, channel, claim_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8]
if claim_ttl ~= '' then
  if not redis.call('SET', KEYS[3], ARGV[9], 'NX', 'EX', claim_ttl) then
    return redis.call('GET', KEYS[3])
  end
end
for i = 9, 8 + n do
  redis.call('SET', prefix .. ARGV[i], record, 'EX', ttl)
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
for i = 9 + n, 8 + 2 * n do
  redis.call('LPUSH', KEYS[2], ARGV[i])
end
if channel ~= '' then
  for i = 9 + 2 * n, 8 + 3 * n do
    redis.call('PUBLISH', channel, ARGV[i])
  end
end
return n
"""
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()  # noqa: S324  # Redis names scripts by SHA-1


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
    args: tuple[str | int, ...] = (*keys, *head, len(ids), channel, claim_ttl, *ids, *messages, *events)
    try:
        reply = client.evalsha(SHA, 3, *args)
    except NoScriptError:
        reply = client.eval(SOURCE, 3, *args)
    if isinstance(reply, bytes):
        return reply.decode()
    return reply if isinstance(reply, str) else None
