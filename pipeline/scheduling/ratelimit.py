"""Cluster-wide rate limits: one GCRA limiter in Redis shared by every worker on every host.

A typed task declares ``cluster_rate="20/s"`` (optionally ``cluster_burst=5`` and
``rate_key=lambda job: job.host`` for a limit per destination, customer, ...). One GCRA limiter with
reservation on Redis's own clock gives each job a slot: the worker's fetch takes it in the call that takes the
job (`fetch.lua`, from the key the producer put in `HEADER_RATE_KEY`), and the delivery carries it
(`HEADER_RATE_GRANT`); a job without one, or starting later than GRANT_LATE_S (or half an interval) past it, asks
with one atomic call (`pipeline/lua/rate_acquire.lua`) before the task's function runs. A job given a later slot
is not run, not slept on and not retried: it is published again under the same task id for that slot (parked
if far ahead, see `pipeline.publish`), with its attempt count unchanged, a
`pipeline_rate_slot` header, and a `pipeline_throttled` count. The slot itself (epoch seconds on Redis's clock, judged
by the same script: hosts' clocks play no part) is recorded under the job's id (`RATE_SLOT_KEY`) before the publish;
the deferred job takes that record once (GETDEL) and starts on its slot without taking another (unless it arrives
later than half an interval past it: late jobs ask again, so busy workers cannot bunch deferred jobs into a burst).
The header only says there is a record to take: a producer that writes one (or a grant, which only the worker's own
fetch sets: `pipeline.delivery.fetch`) gets a slot of its own like any other job. The
new message's ETA is the wait from this worker's clock; a worker holding it whose clock is off starts it early or
late by as much, and the script then tells it to wait again for the same slot (early) or asks again (late).
Its state meanwhile is THROTTLED ("scheduled"). An async job of the asyncio pool awaits a slot up to AWAIT_IN_PLACE_S
ahead where it is, on the pool's event loop (and asks for it there, with the loop's own client), so neither costs the
worker's thread a wait.
Each deferral counts in `pipeline_rate_limit_throttled_total{task}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery.exceptions import Ignore

from pipeline import publish
from pipeline.broker import async_redis, broker_redis
from pipeline.celery_app import get_app
from pipeline.constants import HEADER_RATE_GRANT, HEADER_RATE_SLOT, HEADER_THROTTLED, RATE_SLOT_KEY
from pipeline.errors import TransientError
from pipeline.fairness.rates import ClusterRate
from pipeline.lua import script, source
from pipeline.observability import metrics
from pipeline.pools import aio
from pipeline.task import PipelineTask, request_header


def _redis_key(limit: ClusterRate, task_name: str, job: Any) -> str:
    return limit.redis_key(task_name, limit.suffix(job))


_limited: tuple[int, int, list[tuple[str, ClusterRate]]] | None = None


def limited_tasks() -> list[tuple[str, ClusterRate]]:
    """The app's tasks with a cluster-wide limit, and their limits (the worker's fetch takes their slots)."""
    global _limited  # one list per app and task count, built again when either changes
    tasks = get_app().tasks
    if _limited is None or _limited[:2] != (id(tasks), len(tasks)):
        limits = ((name, getattr(t, "cluster_limit", None)) for name, t in tasks.items())
        _limited = (id(tasks), len(tasks), [(name, limit) for name, limit in limits if isinstance(limit, ClusterRate)])
    return _limited[2]


#: A job whose fetch took its slot starts on it up to this long after it (or half an interval, if longer); later (it
#: waited in a worker's prefetch), it asks again, so jobs held back cannot start together as a burst.
GRANT_LATE_S = 0.05


def _granted(limit: ClusterRate, task_name: str, job: Any, request: Any) -> tuple[float, float] | None:
    """The slot the worker's fetch took for this delivery (`fetch.lua`), as `acquire` answers, if it is this job's
    and it is not late for it (GRANT_LATE_S)."""
    grant = request_header(request, HEADER_RATE_GRANT)
    if not isinstance(grant, dict) or grant.get("key") != _redis_key(limit, task_name, job):
        return None
    try:
        wait, slot = float(grant["due"]) - time.time(), float(grant["slot"])
    except (KeyError, TypeError, ValueError):
        return None
    if -wait > max(GRANT_LATE_S, limit.interval() / 2):
        return None
    return max(0.0, wait), slot


def acquire(
    limit: ClusterRate, task_name: str, job: Any, carried: float | None = None, deferred: str | None = None
) -> tuple[float, float]:
    """Take a slot, unless `carried` (the slot a deferred job was given, epoch seconds on Redis's clock) is still
    good; return the seconds to wait for the slot (0: start now) and the slot, on Redis's clock. `deferred`: the id of
    a job that says it was deferred; the slot carried is the one recorded for it (`record`), if any, taken once."""
    keys = [_redis_key(limit, task_name, job)]
    with broker_redis() as client:
        if deferred is not None:
            carried = _recorded(client.getdel(RATE_SLOT_KEY.format(id=deferred)))
        reply = script("rate_acquire")(keys=keys, args=_args(limit, carried), client=client)
    return _wait_and_slot(reply)


def _recorded(value: Any) -> float | None:
    return None if value is None else float(value)


#: How long a deferred job's slot stays recorded past the moment it could still start on it (seconds): its message may
#: wait in a busy worker's prefetch; later, it asks for a new slot anyway.
RECORD_SLACK_S = 300.0


def record(limit: ClusterRate, job_id: str, slot: float, wait: float) -> None:
    """Record the slot a deferred job was given (`RATE_SLOT_KEY`), for it alone to take when it starts."""
    ttl_ms = int((wait + limit.interval() / 2 + RECORD_SLACK_S) * 1000)
    with broker_redis() as client:
        client.set(RATE_SLOT_KEY.format(id=job_id), repr(slot), px=ttl_ms)


def _args(limit: ClusterRate, carried: float | None) -> list[Any]:
    """`rate_acquire.lua`'s ARGV: the interval and the burst's tolerance in ms, and the carried slot (ms) or ""."""
    interval_ms, tolerance_ms = limit.interval_and_tolerance_ms()
    return [interval_ms, tolerance_ms, "" if carried is None else carried * 1000]


def _wait_and_slot(reply: Any) -> tuple[float, float]:
    wait, slot = reply
    return max(0.0, float(wait) / 1000), float(slot) / 1000


#: An async job given a slot at most this far ahead awaits it in place (the worker goes on with its other jobs) instead
#: of being published again for it.
AWAIT_IN_PLACE_S = 1.0
#: Longest wait for the asyncio pool's own client (connect or answer), seconds.
ASYNC_CLIENT_TIMEOUT_S = 10.0


def _script_client() -> tuple[Any, Any] | None:
    """This event loop's asyncio client and its `rate_acquire` script, or None (a Sentinel broker)."""
    client = aio.per_loop("broker.redis", lambda: async_redis(ASYNC_CLIENT_TIMEOUT_S), _aclose)
    if client is None:
        return None
    return client, aio.per_loop("rate_acquire", lambda: client.register_script(source("rate_acquire")), _noop)


async def _aclose(client: Any) -> None:
    if client is not None:
        await client.aclose()


async def _noop(_: Any) -> None:
    return None


async def acquire_async(
    limit: ClusterRate, task_name: str, job: Any, carried: float | None, deferred: str | None = None
) -> tuple[float, float]:
    """`acquire`, awaited on the asyncio pool's loop with its own client: the worker's thread goes on with other jobs
    meanwhile (with Sentinel, `acquire` itself, through the pool that follows failovers)."""
    on = _script_client()
    if on is None:
        return acquire(limit, task_name, job, carried, deferred)
    client, rate_acquire = on
    if deferred is not None:
        carried = _recorded(await client.getdel(RATE_SLOT_KEY.format(id=deferred)))
    keys = [_redis_key(limit, task_name, job)]
    return _wait_and_slot(await rate_acquire(keys=keys, args=_args(limit, carried), client=client))


def _acquire(limit: ClusterRate, task_name: str, job: Any, deferred: str | None) -> tuple[float, float]:
    """`acquire`; in an async job of the asyncio pool, on its event loop (see `acquire_async`)."""
    if aio.in_job():
        return aio.resolve(acquire_async(limit, task_name, job, None, deferred))  # type: ignore[no-any-return]
    return acquire(limit, task_name, job, None, deferred)


@contextmanager
def _limiter() -> Iterator[None]:
    try:
        yield
    except redis.exceptions.RedisError as exc:  # the limiter could not answer: the job has not begun; it retries
        raise TransientError(f"the cluster rate limiter could not be asked: {exc!r}") from exc


def admit(task: PipelineTask, job: Any) -> None:
    """Return when `job` may run now (or its task has no cluster limit); otherwise publish it again for its
    slot and raise `Ignore`. Installed in `pipeline.task.ADMISSION` by the worker's runtime."""
    limit = task.cluster_limit
    if limit is None:
        return
    request = task.request
    deferred = None if request_header(request, HEADER_RATE_SLOT) is None else str(request.id)
    # A deferred job on (about) the slot recorded for it starts; without one, or late for it, it asks again. Judged in
    # the script, on Redis's clock: the slot was given by one host and is checked by another.
    with _limiter():
        granted = _granted(limit, task.name, job, request) if deferred is None else None
        wait, slot = granted or _acquire(limit, task.name, job, deferred)
    if wait <= 0:
        return
    if wait <= AWAIT_IN_PLACE_S and aio.in_job():
        aio.resolve(asyncio.sleep(wait))  # its slot is reserved: it waits on the loop, beside the other jobs
        return
    with _limiter():
        record(limit, str(request.id), slot, wait)  # before the publish: the deferred job finds it
    throttled = int(request_header(request, HEADER_THROTTLED) or 0) + 1
    headers = {**(request.headers or {}), HEADER_RATE_SLOT: slot, HEADER_THROTTLED: throttled}
    again = task.signature_from_request(request, headers=headers)
    # The ETA is on this worker's clock (Celery holds the message until the holder's clock reaches it): a worker
    # whose clock is off by more than half an interval is told to wait again, for the same slot.
    due = time.time() + wait
    publish.schedule(lambda producer, eta: again.apply_async(producer=producer, eta=eta), str(request.id), due)
    task.update_state(state="THROTTLED", meta={"until": slot, "throttled": throttled})
    metrics.rate_limit_throttled.labels(task=task.name).inc()
    raise Ignore(f"rate limit {limit.rate}: deferred {wait:.3f}s")
