"""Leases renewed by real workers: a live worker's job running, or held for its countdown, longer than several leases
is never delivered twice, whatever the pool. Fencing of a frozen worker: `tests/faults/test_lease_fencing.py`; Redis
outages under running jobs: `tests/faults/test_lease_outages.py`; `kill -9`: `tests/faults/test_lease_kills.py`.

Each test has its own redis-server (AOF on) for the broker and a ledger Redis the jobs record their starts
(`test:ledger:<key>`) and completions (`test:done:<key>`) in, and runs `celery worker` subprocesses on the
`default` queue. Every worker sharing a broker must use the same LEASE_SECONDS (a sweep judges other
workers' leases by its own), so these workers never share the session's Redis.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from tests.faults.ledger import SHORT_LEASE, done, env_for, send, settled, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def _runs_once_on_two_workers(
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


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_a_job_of_several_leases_with_an_idle_peer_runs_exactly_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery, pool: str
) -> None:
    """The renewal thread renews whatever the pool: with solo the main process itself runs the job."""
    sleep_s = 25 if pool == "prefork" else 15
    _runs_once_on_two_workers(own_redis, ledger_redis, make_worker, lambda key: send(producer, key, sleep_s), pool)


def test_a_countdown_held_past_several_leases_runs_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A reserved message (a countdown the worker holds in its timer) is renewed like a running one."""

    def send(key: str) -> str:
        return str(producer.send_task("test.ledger", args=[{"key": key}], queue="default", countdown=20).id)

    _runs_once_on_two_workers(own_redis, ledger_redis, make_worker, send)
