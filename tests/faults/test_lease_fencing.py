"""Fencing with real workers: a worker frozen (SIGSTOP) past its lease neither runs nor acknowledges the jobs a peer
took over, and one frozen past its stop deadline with no peer goes on with its job.

Brokers, ledgers and workers as in `tests/faults/test_leases.py` (each test its own broker, one LEASE_SECONDS for
every worker on it).
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
from tests.faults.ledger import SHORT_LEASE, done, env_for, send, settled, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def test_a_worker_frozen_past_its_lease_neither_runs_nor_acknowledges_the_jobs_a_peer_took(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """The frozen worker holds two jobs: one running, one prefetched behind it. A peer takes both over; thawed,
    the worker terminates the first, drops the second without running it, and acknowledges neither."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    frozen = make_worker(f"fence-a-{key[:6]}", env={**env, "WORKER_PREFETCH_MULTIPLIER": "2"}, concurrency=1)
    jobs = [send(producer, key, 20) for _ in range(2)]
    wait_for(lambda: starts(ledger_redis, key), 30, 0.05, what="the first job to start")
    broker = own_redis.client()
    wait_for(lambda: broker.hlen(LEASE_KEY) == 2, 10, 0.05, what="the second job to be prefetched")
    peer = make_worker(f"fence-b-{key[:6]}", env=env, concurrency=2)
    frozen.kill_group(signal.SIGSTOP)  # the whole worker: main process (and its renewal thread) and pool child
    stopped_at = time.time()
    try:
        wait_for(lambda: len(starts(ledger_redis, key)) >= 3, 40, 0.1, what="the peer to take both jobs over")
    finally:
        frozen.kill_group(signal.SIGCONT)
    taken_after = starts(ledger_redis, key)[1]["t"] - stopped_at
    wait_for(lambda: "not run here" in frozen.log(), 10, 0.1, what="the thawed worker to find its leases gone")
    time.sleep(2)  # the thawed worker's fence and its fenced acknowledgements have run by now
    holders = {v.decode().split(":")[1] for v in broker.hvals(LEASE_KEY)}
    assert broker.hlen("unacked") == 2 and holders == {str(peer.pid)}, "the thawed worker touched the peer's jobs"
    wait_for(lambda: len(done(ledger_redis, key)) >= 2, 40, 0.2, what="the peer to finish both jobs")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="the peer's acknowledgements, with no copy left to run")
    print(f"frozen worker's jobs restarted on the peer {taken_after:.1f} s after SIGSTOP (lease 6 s)")
    assert taken_after <= 6 + 1 + 3, taken_after  # the lease, a 1 s sweep, and a margin for a loaded machine
    assert done(ledger_redis, key) == collections.Counter(dict.fromkeys(jobs, 1))
    assert len(starts(ledger_redis, key)) == 3  # the prefetched job never started on the frozen worker
    assert {producer.AsyncResult(job).state for job in jobs} == {"SUCCESS"}
    assert frozen.proc is not None and frozen.proc.poll() is None
    assert "terminating it here" in frozen.log()


def test_a_worker_frozen_past_its_stop_deadline_with_no_peer_goes_on_with_its_job(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Frozen whole (SIGSTOP) for 5 s, longer than the 4 s a lease may go unconfirmed (lease 6 s), a worker renewed
    nothing; nobody took its job. Thawed, it lets its renewal confirm the lease before judging the deadlines: the
    job is not stopped, it completes once, where it started."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    worker = make_worker(f"frozen-alone-{key[:6]}", env=env, concurrency=1)
    job = send(producer, key, 8)
    wait_for(lambda: starts(ledger_redis, key), 30, 0.05, what="the job to start")
    worker.kill_group(signal.SIGSTOP)
    try:
        time.sleep(5)  # the freeze itself, not a wait for an outcome
    finally:
        worker.kill_group(signal.SIGCONT)
    wait_for(lambda: job in done(ledger_redis, key), 30, 0.1, what="the job to finish")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="its acknowledgement")
    assert done(ledger_redis, key) == collections.Counter({job: 1}) and len(starts(ledger_redis, key)) == 1
    assert producer.AsyncResult(job).state == "SUCCESS"
    assert "LeaseLost" not in worker.log() and "abandoned" not in worker.log()
