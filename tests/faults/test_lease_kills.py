"""`kill -9` of a worker holding leased jobs, default settings: its jobs come back within a lease plus a sweep and
finish once on a peer. A worker killed at any instant under a stream of jobs:
`tests/faults/test_lease_kills_under_load.py`.

Each test has its own redis-server (AOF on) for the broker and a ledger Redis (`tests.faults.ledger`), and runs
`celery worker` subprocesses on the `default` queue (every worker sharing a broker uses the same LEASE_SECONDS).
"""

from __future__ import annotations

import collections
import signal
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import LEASE_KEY
from tests.faults.ledger import done, env_for, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def test_kill_9_with_three_jobs_in_flight_all_finish_once_on_a_peer_within_lease_plus_sweep(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Default LEASE_SECONDS (30) and sweep interval (10 s): the bound is 40 s from the kill to the restore. Each job
    sleeps 60 s on its first delivery, so it is still running when its worker is killed however long the peer takes to
    start (a 5 s job once finished first on a loaded machine), and finishes at once on its second."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, UNACKED_RESTORE_INTERVAL="10")
    first = make_worker(f"kill9-a-{key[:6]}", env=env, concurrency=3)
    keys = [f"{key}-{n}" for n in range(3)]  # a key each: `sleep_once` counts the deliveries of its key
    payloads = [{"key": k, "sleep_s": 60, "sleep_once": True} for k in keys]
    jobs = [str(producer.send_task("test.ledger", args=[p], queue="default").id) for p in payloads]

    def all_starts() -> list[dict[str, Any]]:
        return [s for k in keys for s in starts(ledger_redis, k)]

    def all_done() -> collections.Counter[str]:
        return sum((done(ledger_redis, k) for k in keys), collections.Counter())

    wait_for(lambda: len(all_starts()) >= 3, 30, 0.05, what="three jobs to start")
    peer = make_worker(f"kill9-b-{key[:6]}", env=env, concurrency=3)
    assert not all_done()
    first.kill_group(signal.SIGKILL)
    killed_at = time.time()
    first.wait(10)
    wait_for(lambda: set(jobs) <= set(all_done()), 60, 0.1, what="the three jobs on the peer")
    restarts = [s for s in all_starts() if s["t"] > killed_at]
    recovery = max(s["t"] for s in restarts) - killed_at
    print(f"kill -9 → every job started again on the peer after {recovery:.1f} s (bound: lease 30 + sweep 10)")
    assert all_done() == collections.Counter(dict.fromkeys(jobs, 1))
    assert sorted(s["task_id"] for s in restarts) == sorted(jobs)
    assert recovery <= 30 + 10 + 3, recovery
    broker = own_redis.client()
    # A job is done a loop iteration before its acknowledgement lands.
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.hlen(LEASE_KEY) == 0, 10, 0.1, what="the acknowledgements")
    assert peer.proc is not None and peer.proc.poll() is None
