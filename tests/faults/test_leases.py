"""Leases renewed by real workers: a countdown the worker holds longer than several leases is never delivered twice. A
running job longer than several leases: `tests/faults/test_lease_renewal.py`; fencing of a frozen worker:
`tests/faults/test_lease_fencing.py`; Redis outages under running jobs: `tests/faults/test_lease_outages.py`;
`kill -9`: `tests/faults/test_lease_kills.py`.

Each test has its own redis-server (AOF on) for the broker and a ledger Redis the jobs record their starts
(`test:ledger:<key>`) and completions (`test:done:<key>`) in, and runs `celery worker` subprocesses on the
`default` queue. Every worker sharing a broker must use the same LEASE_SECONDS (a sweep judges other
workers' leases by its own), so these workers never share the session's Redis.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from tests.faults.ledger import runs_once_on_two_workers
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


def test_a_countdown_held_past_several_leases_runs_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A reserved message (a countdown the worker holds in its timer) is renewed like a running one."""

    def send(key: str) -> str:
        return str(producer.send_task("test.ledger", args=[{"key": key}], queue="default", countdown=20).id)

    runs_once_on_two_workers(own_redis, ledger_redis, make_worker, send)
