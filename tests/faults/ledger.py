"""Jobs on a test's own broker, recorded in a ledger Redis: what the lease fault tests send and count.

A `test.ledger` job records each start in `test:ledger:<key>` and each completion in `test:done:<key>` of the ledger
(`TEST_LEDGER_URL`), which the test never stops, so the record is whole across kills and outages. A `test.await` job
(the asyncio pool's) records `start`, `finish` and `cancelled` events in `test:run:<key>`, with the ledger's clock.
`runs_once_on_two_workers` is the lease renewal tests' scenario: one job, two workers, one run.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from tests.support.procs import RedisServer, wait_for, waiting

#: A short lease for tests about the mechanism: renewed every 2 s, restored 6 s after the last renewal.
SHORT_LEASE = {"LEASE_SECONDS": "6", "UNACKED_RESTORE_INTERVAL": "1"}
SHORT_LEASE_S = float(SHORT_LEASE["LEASE_SECONDS"])


def env_for(own_redis: RedisServer, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger.url, **extra}


def send(producer: Celery, key: str, sleep_s: float) -> str:
    return str(producer.send_task("test.ledger", args=[{"key": key, "sleep_s": sleep_s}], queue="default").id)


def starts(ledger: RedisServer, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in ledger.client().lrange(f"test:ledger:{key}", 0, -1)]


def done(ledger: RedisServer, key: str) -> collections.Counter[str]:
    return collections.Counter(x.decode() for x in ledger.client().lrange(f"test:done:{key}", 0, -1))


def settled(broker: RedisServer) -> bool:
    """Nothing queued or held: no job can run (again) from here on."""
    client = broker.client()
    return client.hlen("unacked") == 0 and waiting(client, "default") == 0


def runs(ledger: RedisServer, key: str) -> list[dict[str, Any]]:
    """The `test:run:<key>` records of `test.await` jobs, in the order they landed."""
    return [json.loads(r) for r in ledger.client().lrange(f"test:run:{key}", 0, -1)]


def run_count(ledger: RedisServer, key: str, event: str) -> collections.Counter[str]:
    """How many `event` records each task id has in `test:run:<key>`."""
    return collections.Counter(r["task_id"] for r in runs(ledger, key) if r["event"] == event)


def past_the_lease(ledger: RedisServer, key: str, lease_s: float = SHORT_LEASE_S) -> None:
    """Wait until 2 x `lease_s` after the last `finish` record (the ledger's clock): a delivery left to lapse after
    that finish has been swept and run again by then."""
    last = max(r["t"] for r in runs(ledger, key) if r["event"] == "finish")

    def past() -> bool:
        seconds, micros = ledger.client().time()
        return bool(seconds + micros / 1e6 >= last + 2 * lease_s)

    wait_for(past, 4 * lease_s, 0.2, what="two leases past the last finish")


def each_ran_once(ledger: RedisServer, key: str, jobs: list[str], timeout: float = 90) -> None:
    """Wait until every job of `jobs` finished, then until two leases past the last finish; assert each started and
    finished exactly once (run twice: 0; lost: 0) and nothing else ran under `key`."""
    wait_for(lambda: set(jobs) <= set(run_count(ledger, key, "finish")), timeout, 0.1, what="every job to finish")
    past_the_lease(ledger, key)
    once = collections.Counter(dict.fromkeys(jobs, 1))
    for event in ("start", "finish"):
        counted = run_count(ledger, key, event)
        off = {job for job in set(jobs) | set(counted) if counted[job] != 1}
        assert not off, [r for r in runs(ledger, key) if r["task_id"] in off]  # each job's records, in order
        assert counted == once


def each_finished_once(ledger: RedisServer, key: str, jobs: list[str], timeout: float = 90) -> None:
    """As `each_ran_once`, for jobs a shutdown may stop: each finished exactly once (lost: 0, twice: 0), and a job
    started again only after its earlier run was stopped (recorded `cancelled`) before it finished."""
    wait_for(lambda: set(jobs) <= set(run_count(ledger, key, "finish")), timeout, 0.1, what="every job to finish")
    past_the_lease(ledger, key)
    assert run_count(ledger, key, "finish") == collections.Counter(dict.fromkeys(jobs, 1))
    stopped = run_count(ledger, key, "cancelled")
    assert run_count(ledger, key, "start") == collections.Counter({job: 1 + stopped[job] for job in jobs})


def runs_once_on_two_workers(
    own_redis: RedisServer,
    ledger_redis: RedisServer,
    make_worker: Any,
    send: Callable[[str], str],
    pool: str = "prefork",
) -> None:
    """Two workers with a short lease; the job `send(key)` publishes runs once, and only once, on one of them."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    for name in "ab":
        make_worker(f"once-{name}-{key[:6]}", env=env, concurrency=1, pool=pool)
    job = send(key)
    wait_for(lambda: done(ledger_redis, key), 60, 0.2, what="the job to finish")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="its acknowledgement, with no copy left to run")
    assert done(ledger_redis, key) == collections.Counter({job: 1})
    assert len(starts(ledger_redis, key)) == 1, starts(ledger_redis, key)
