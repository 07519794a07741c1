"""Cluster-wide rate limits: one GCRA limiter in Redis shared by every worker on every host.

A typed task declares ``cluster_rate="20/s"`` (optionally ``cluster_burst=5`` and
``rate_key=lambda job: job.host`` for a limit per destination, customer, ...). Before the task's
function runs, one atomic Lua call on Redis (GCRA with reservation, Redis's own clock) either lets the
job start now or reserves the next free slot for it. A job given a later slot is not run, not slept on
and not retried: it is published again under the same task id for that slot (parked if far ahead, see
`pipeline.delayed`), with its attempt count unchanged, a `pipeline_rate_slot` header that lets it start
without asking again (unless it arrives later than half an interval past it: late jobs ask again, so
busy workers cannot bunch deferred jobs into a burst), and a `pipeline_throttled` count. Its state
meanwhile is THROTTLED ("scheduled").
Each deferral counts in `pipeline_rate_limit_throttled_total{task}`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore

from pipeline import delayed, metrics
from pipeline.broker import broker_redis
from pipeline.constants import HEADER_RATE_SLOT, HEADER_THROTTLED, RATE_LIMIT_KEY

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}

# GCRA with reservation. ARGV: emission interval T and burst tolerance tau, in ms. Returns the wait (ms)
# before the caller's slot, 0 when it may start now; the slot is taken either way.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local start = tat - tau
if start < now then start = now end
local new_tat = tat + interval
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now + tau) + 1000)
return tostring(start - now)
"""


def parse_rate(rate: str) -> float:
    """Seconds between two jobs for a Celery-style rate ("20/s", "100/m", "0.5/h")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)/([smh])", rate.strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"rate {rate!r}: expected N/s, N/m or N/h with N > 0")
    return _UNITS[match.group(2)] / float(match.group(1))


@dataclass(frozen=True)
class ClusterLimit:
    """A limit shared by all workers: `rate`, up to `burst` jobs at once, per `key(job)` when given."""

    rate: str
    burst: int = 1
    key: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        if self.burst < 1:
            raise ValueError("cluster_burst must be at least 1")

    @property
    def tolerance(self) -> float:
        """How late a deferred job may start on its slot: half an interval, so starts stay spread."""
        return parse_rate(self.rate) / 2

    def redis_key(self, task_name: str, job: Any) -> str:
        suffix = f":{self.key(job)}" if self.key is not None else ""
        return RATE_LIMIT_KEY.format(task=task_name) + suffix

    def acquire(self, task_name: str, job: Any) -> float:
        """Take a slot; return the seconds to wait for it (0: start now)."""
        interval_ms = parse_rate(self.rate) * 1000
        with broker_redis() as client:
            wait = client.eval(_ACQUIRE, 1, self.redis_key(task_name, job), interval_ms, (self.burst - 1) * interval_ms)
        return max(0.0, float(wait) / 1000)


def _header(request: Any, name: str) -> Any:
    return (request.headers or {}).get(name) or getattr(request, name, None)


def enforce(task: Any, limit: ClusterLimit, job: Any) -> None:
    """Return when `job` may run now; otherwise publish it again for its slot and raise `Ignore`."""
    request = task.request
    slot = _header(request, HEADER_RATE_SLOT)
    if slot is not None and time.time() - float(slot) <= limit.tolerance:
        return  # the slot this message was given when it was deferred, and it is (about) now
    # No slot, or arriving late for it (busy workers): ask again, so late jobs never bunch up.
    wait = limit.acquire(task.name, job)
    if wait <= 0:
        return
    slot = time.time() + wait
    throttled = int(_header(request, HEADER_THROTTLED) or 0) + 1
    headers = {**(request.headers or {}), HEADER_RATE_SLOT: slot, HEADER_THROTTLED: throttled}
    again = task.signature_from_request(request, headers=headers)
    delayed.schedule(lambda producer, eta: again.apply_async(producer=producer, eta=eta), request.id, slot)
    task.update_state(state="THROTTLED", meta={"until": slot, "throttled": throttled})
    metrics.rate_limit_throttled.labels(task=task.name).inc()
    raise Ignore(f"rate limit {limit.rate}: deferred {wait:.3f}s")
