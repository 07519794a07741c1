"""Leases on one clock: workers whose wall clocks are 90 s off, beside a correct one, each keep their own jobs.

Three `celery worker` processes share one broker (a redis-server of this test's own): one whose clock is 90 s behind,
one correct, one 90 s ahead (libfaketime preloaded: `tests.support.faketime`). A lease judged by the holder's clock
against a sweeper's makes the behind worker's jobs look expired to both others, and the correct worker's to the one
ahead. Each worker holds two jobs of three leases each (5 s lease, 1 s sweep, prefetch one job per process); every
job must start once, finish once and store its result from the worker that started it, with nothing restored and no
lease lost anywhere. Jobs (`test.run`) record each start and finish in a ledger Redis with the ledger's own time.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import LEASE_KEY
from tests.support import faketime
from tests.support.procs import RedisServer, Worker, wait_for, waiting

pytestmark = pytest.mark.ha

LEASE_S = 5
ENV = {"LEASE_SECONDS": str(LEASE_S), "UNACKED_RESTORE_INTERVAL": "1", "WORKER_PREFETCH_MULTIPLIER": "1"}
SKEW_S = 90
#: Each worker's clock against the real one.
CLOCKS = {"behind": -SKEW_S, "true": 0, "ahead": SKEW_S}
CONCURRENCY = 2
JOB_S = 3 * LEASE_S


@pytest.fixture
def workers(own_redis: RedisServer, ledger_redis: RedisServer, work_dir: Path) -> Iterator[dict[str, Worker]]:
    """One worker per entry of CLOCKS, started together; stopped by PID (and libfaketime's shared memory removed)."""
    tag = uuid.uuid4().hex[:6]
    base = work_dir / f"skew-{tag}"
    env = {**ENV, "REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger_redis.url}
    found: dict[str, Worker] = {}
    for name, offset in CLOCKS.items():
        extra = faketime.skewed_env(offset, base / f"faketime-{name}") if offset else {}
        if extra:
            measured = faketime.clock_offset(extra)
            assert abs(measured - offset) < 2, f"libfaketime did not take: clock off by {measured:.1f} s"
        found[name] = Worker(f"skew-{name}-{tag}", base, {**env, **extra}, concurrency=CONCURRENCY)
    try:
        with ThreadPoolExecutor(len(found)) as pool:
            for started in [pool.submit(w.start) for w in found.values()]:
                started.result()
        yield found
    finally:
        pids = [w.proc.pid for w in found.values() if w.proc is not None]
        for worker in found.values():
            worker.terminate()
        for worker in found.values():
            worker.stop()
        faketime.remove_shared(pids)


def _records(ledger: RedisServer, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in ledger.client().lrange(f"test:run:{key}", 0, -1)]


def _all_started(ledger: RedisServer, key: str, count: int) -> list[dict[str, Any]] | None:
    records = _records(ledger, key)
    return records if len(_events(records, "start")) == count else None


def _events(records: list[dict[str, Any]], event: str) -> collections.Counter[str]:
    return collections.Counter(r["task_id"] for r in records if r["event"] == event)


def test_workers_90_s_behind_and_ahead_of_a_correct_one_each_run_their_own_jobs_once(
    own_redis: RedisServer, ledger_redis: RedisServer, producer: Celery, workers: dict[str, Worker]
) -> None:
    """Six jobs of three leases each, two held by each worker: each runs once, where it started, to the end."""
    key = uuid.uuid4().hex[:10]
    node_of = {w.name: name for name, w in workers.items()}
    jobs = [
        str(producer.send_task("test.run", args=[{"key": key, "sleep_s": JOB_S}], queue="default").id)
        for _ in range(CONCURRENCY * len(workers))
    ]
    started = wait_for(lambda: _all_started(ledger_redis, key, len(jobs)), 30, 0.05, what="every job to start")
    assert isinstance(started, list)
    holders = collections.Counter(node_of[r["node"].split("@")[0]] for r in started)
    assert holders == dict.fromkeys(CLOCKS, CONCURRENCY), holders  # each worker holds two jobs (its prefetch)
    first = {r["task_id"]: node_of[r["node"].split("@")[0]] for r in started}

    def all_done() -> bool:
        return all(producer.AsyncResult(job).ready() for job in jobs)

    wait_for(all_done, JOB_S * 4, 0.2, what="every job's result")
    client = own_redis.client()
    wait_for(lambda: client.hlen("unacked") == 0 and waiting(client, "default") == 0, 15, 0.1, what="acknowledgements")
    records = _records(ledger_redis, key)
    runs = [(r["t"], r["event"], node_of[r["node"].split("@")[0]], r["task_id"][:8]) for r in records]
    began = {r["task_id"]: r["t"] for r in records if r["event"] == "start"}
    spans = [r["t"] - began[r["task_id"]] for r in records if r["event"] == "finish"]
    print(f"runs (ledger time, event, worker, job): {runs}")
    print(f"job run times: {min(spans, default=0):.1f}-{max(spans, default=0):.1f} s (each should be {JOB_S} s)")

    restarted = {f"{job[:8]} (held by {first[job]})": n for job, n in _events(records, "start").items() if n > 1}
    assert not restarted, f"jobs started more than once: {restarted}; runs: {runs}"
    assert _events(records, "finish") == collections.Counter(dict.fromkeys(jobs, 1)), runs
    stored = {job: node_of[producer.AsyncResult(job).result["node"].split("@")[0]] for job in jobs}
    assert stored == first, "a result stored by a worker other than the one that started the job"
    for name, worker in workers.items():
        log = worker.log()
        assert "whose lease expired" not in log, f"the {name} worker restored a live peer's jobs"
        assert "lease lost" not in log, f"the {name} worker lost its own jobs"
    assert client.hlen(LEASE_KEY) == 0
