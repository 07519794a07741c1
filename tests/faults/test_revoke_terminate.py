"""Celery's `revoke(terminate=True)` stops a running job on every pool as `pipeline cancel` does: the job never reaches
its side effect, its state is REVOKED, its message is acknowledged and its lease gone, and it does not run again in
2 x LEASE_SECONDS; a revoked job still waiting in the worker is dropped unrun.

Workers are `celery worker` (REMAP_SIGTERM=SIGQUIT, as the start scripts run them) on the `default` queue of a
Redis of the test's own, with a short lease. `test.run` (a plain typed job), `test.run_async` (an `async def` job)
and `plain.run` (a task as Celery's tutorials write it, `@app.task`) record `start`, then `finish` after their sleep
(the side effect), in the ledger (`tests.faults.ledger`). The plain ones sleep in short steps, as Python code runs: a
plain job of the asyncio pool is stopped at its next Python instruction, in its thread; one held in a single blocking
C call past the time given to unwind is abandoned and its process recycled (`pipeline.runtime.plainjobs`).
The revoke is sent as Celery's users send it:
`AsyncResult.revoke` of a plain Celery app on the same broker, or the `celery control` command.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import LEASE_KEY
from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, env_for, run_count, runs, settled
from tests.support.procs import ROOT, RedisServer, Worker, wait_for

pytestmark = pytest.mark.faults

#: How long a job sleeps before its side effect (`finish`): well inside the 2 x LEASE_SECONDS watched after a revoke.
SLEEP_S = 8.0
#: `-P` and concurrency of each pool the pipeline runs.
POOLS = {"prefork": ("prefork", 1), "solo": ("solo", 1), "asyncio": ("custom", 4)}


def start_worker(make_worker: Any, broker: RedisServer, ledger: RedisServer, kind: str, key: str) -> Worker:
    pool, concurrency = POOLS[kind]
    env = env_for(broker, ledger, **SHORT_LEASE, TEST_NODE=f"{kind}-{key[:6]}")
    if kind == "asyncio":
        env["CELERY_CUSTOM_WORKER_POOL"] = POOL
    return make_worker(f"revoke-{kind}-{key[:6]}", env=env, pool=pool, concurrency=concurrency)  # type: ignore[no-any-return]


def args_for(task: str, key: str, sleep_s: float) -> list[Any]:
    """`plain.run` takes its arguments as Celery's tutorials pass them; the typed tasks one payload object."""
    return [key, sleep_s] if task.startswith("plain.") else [{"key": key, "sleep_s": sleep_s}]


def send(producer: Celery, task: str, key: str, sleep_s: float = SLEEP_S, **options: Any) -> str:
    return str(producer.send_task(task, args=args_for(task, key, sleep_s), queue="default", **options).id)


def key_of(result: Any) -> str:
    return str(result if isinstance(result, str) else result["key"])


def revoked_and_settled(producer: Celery, broker: RedisServer, task_id: str) -> None:
    """REVOKED, its message acknowledged (nothing queued or held) and no lease left."""
    wait_for(lambda: producer.AsyncResult(task_id).state == "REVOKED", 20, 0.05, what="the job's state to be REVOKED")
    wait_for(lambda: settled(broker), 20, 0.05, what="its message to be acknowledged")
    assert broker.client().hlen(LEASE_KEY) == 0


def two_leases_past(ledger: RedisServer, key: str) -> None:
    """Wait until 2 x LEASE_SECONDS after the last record of `key` (the ledger's clock): a delivery left to lapse has
    been swept and run again by then, and a job not stopped has written its `finish`."""
    last = max(r["t"] for r in runs(ledger, key))

    def past() -> bool:
        seconds, micros = ledger.client().time()
        return bool(seconds + micros / 1e6 >= last + 2 * SHORT_LEASE_S)

    wait_for(past, 4 * SHORT_LEASE_S, 0.2, what="two leases past the last record")


@pytest.mark.parametrize(
    ("kind", "task", "signal"),
    [
        ("prefork", "test.run", None),
        ("prefork", "test.run", "SIGTERM"),
        ("solo", "test.run", None),
        ("solo", "plain.run", None),
        ("asyncio", "test.run_async", None),
        ("asyncio", "test.run", None),
        ("asyncio", "plain.run", None),
    ],
    ids=[
        "prefork",
        "prefork-sigterm-as-flower-sends-it",
        "solo",
        "solo-celery-task",
        "asyncio-async-job",
        "asyncio-plain-job",
        "asyncio-plain-celery-task",
    ],
)
def test_revoke_with_terminate_stops_a_running_job_revoked_acknowledged_never_run_again(
    own_redis: RedisServer,
    ledger_redis: RedisServer,
    make_worker: Any,
    producer: Celery,
    kind: str,
    task: str,
    signal: str | None,
) -> None:
    """Flower's terminate button sends SIGTERM, which pool processes ignore under REMAP_SIGTERM=SIGQUIT: the job is
    killed as a cancel kills it."""
    key = uuid.uuid4().hex
    start_worker(make_worker, own_redis, ledger_redis, kind, key)
    job = send(producer, task, key)
    wait_for(lambda: run_count(ledger_redis, key, "start")[job] == 1, 30, 0.05, what="the job to start")
    producer.AsyncResult(job).revoke(terminate=True, signal=signal)
    revoked_and_settled(producer, own_redis, job)
    two_leases_past(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({job: 1})
    assert run_count(ledger_redis, key, "finish") == collections.Counter()  # stopped before its side effect
    assert producer.AsyncResult(job).state == "REVOKED"
    assert settled(own_redis)
    # The worker goes on: the next job runs to its end.
    after = send(producer, task, key, sleep_s=0)
    assert key_of(producer.AsyncResult(after).get(timeout=30)) == key


def test_celery_control_terminate_from_the_command_line_stops_a_celery_task_on_the_asyncio_pool(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """`celery -A pipeline control terminate SIGTERM <id>` (Celery 5's command for a revoke with terminate): the
    main thread, in the job, replies once the job has been stopped."""
    key = uuid.uuid4().hex
    start_worker(make_worker, own_redis, ledger_redis, "asyncio", key)
    job = send(producer, "plain.run", key)
    wait_for(lambda: run_count(ledger_redis, key, "start")[job] == 1, 30, 0.05, what="the job to start")
    argv = [sys.executable, "-m", "celery", "-A", "pipeline", "control", "--timeout", "10", "terminate", "SIGTERM", job]
    env = {**os.environ, "REDIS_URL": own_redis.url}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done
    revoked_and_settled(producer, own_redis, job)
    two_leases_past(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({job: 1})
    assert run_count(ledger_redis, key, "finish") == collections.Counter()
    assert f"{job} flagged as revoked" in done.stdout or "terminate" in done.stdout, done.stdout  # the worker replied


def test_a_revoked_job_waiting_for_its_eta_behind_a_plain_job_is_dropped_unrun(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """On the asyncio pool, an async job held for its ETA while a plain job runs is revoked with terminate: it never
    starts (when it falls due the worker drops it), REVOKED, acknowledged; the plain job runs to its end."""
    key = uuid.uuid4().hex
    start_worker(make_worker, own_redis, ledger_redis, "asyncio", key)
    waiting = send(producer, "test.run_async", key, countdown=3)
    wait_for(lambda: own_redis.client().hlen("unacked") == 1, 30, 0.05, what="the worker to hold the ETA job")
    running = send(producer, "test.run", key)
    wait_for(lambda: run_count(ledger_redis, key, "start")[running] == 1, 30, 0.05, what="the plain job to start")
    producer.AsyncResult(waiting).revoke(terminate=True)
    assert producer.AsyncResult(running).get(timeout=30)["key"] == key
    revoked_and_settled(producer, own_redis, waiting)
    two_leases_past(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({running: 1})
    assert run_count(ledger_redis, key, "finish") == collections.Counter({running: 1})
