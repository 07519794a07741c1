"""The benchmark job, the same in every system: a no-op that makes one pipelined Redis round trip at start.

`SETNX first` and `SET last` (the time), `INCR done`, and `RPUSH lat` (start - enqueue time) when the payload
carries `sent_at`. Rates and latencies are read from these keys afterwards, never from a clock in the
harness. No Celery and no pipeline import: the stock app uses it as is.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

_clients: dict[int, redis.Redis] = {}


def _client() -> redis.Redis:
    pid = os.getpid()
    if pid not in _clients:
        _clients.clear()
        _clients[pid] = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    return _clients[pid]


def keys(run: str) -> dict[str, str]:
    return {name: f"bench:{run}:{name}" for name in ("first", "last", "done", "lat")}


def record(run: str, sent_at: float | None) -> None:
    """What the job does: one round trip recording when it started (and how late)."""
    now = time.time()
    k = keys(run)
    pipe = _client().pipeline(transaction=False)
    pipe.setnx(k["first"], repr(now))
    pipe.set(k["last"], repr(now))
    pipe.incr(k["done"])
    if sent_at is not None:
        pipe.rpush(k["lat"], repr(now - sent_at))
    pipe.execute()


def payload(run: str, sent_at: float | None = None) -> dict[str, Any]:
    return {"run": run} if sent_at is None else {"run": run, "sent_at": sent_at}
