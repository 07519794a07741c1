"""Leases renewed by real workers: a running job longer than several leases, beside an idle peer, is never delivered
twice, whatever the pool. Brokers, ledgers and workers as in `tests/faults/test_leases.py` (each test its own broker,
one LEASE_SECONDS for every worker on it).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from tests.faults.ledger import runs_once_on_two_workers, send
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_a_job_of_several_leases_with_an_idle_peer_runs_exactly_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery, pool: str
) -> None:
    """The renewal thread renews whatever the pool: with solo the main process itself runs the job."""
    sleep_s = 25 if pool == "prefork" else 15
    runs_once_on_two_workers(own_redis, ledger_redis, make_worker, lambda key: send(producer, key, sleep_s), pool)
