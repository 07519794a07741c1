"""What the revoke tests start, send and wait for: a worker of each pool, the ledger jobs, and the revoke with terminate
of a running job (`revoke_with_terminate_runs_never_again`).

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
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery

from pipeline.constants import LEASE_KEY
from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, env_for, run_count, runs, settled
from tests.support.procs import RedisServer, Worker, wait_for

#: How long a job sleeps before its side effect (`finish`): well inside the 2 x LEASE_SECONDS watched after a revoke.
SLEEP_S = 8.0
#: `-P` and concurrency of each pool the pipeline runs.
POOLS = {"prefork": ("prefork", 1), "solo": ("solo", 1), "asyncio": ("custom", 4)}


@dataclass(frozen=True)
class Rig:
    """What a revoke test runs on: its own broker, the ledger, the worker factory and a plain Celery producer on the
    broker (the `revoke_rig` fixture)."""

    broker: RedisServer
    ledger: RedisServer
    make_worker: Any
    producer: Celery


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
    """REVOKED, its message acknowledged (nothing queued or held) and no lease left. Waited for up to a minute each: a
    loaded machine (a whole suite on two cores) has taken more than 20 s to show a stopped job's state."""
    wait_for(lambda: producer.AsyncResult(task_id).state == "REVOKED", 60, 0.05, what="the job's state to be REVOKED")
    wait_for(lambda: settled(broker), 60, 0.05, what="its message to be acknowledged")
    assert broker.client().hlen(LEASE_KEY) == 0


def two_leases_past(ledger: RedisServer, key: str) -> None:
    """Wait until 2 x LEASE_SECONDS after the last record of `key` (the ledger's clock): a delivery left to lapse has
    been swept and run again by then, and a job not stopped has written its `finish`."""
    last = max(r["t"] for r in runs(ledger, key))

    def past() -> bool:
        seconds, micros = ledger.client().time()
        return bool(seconds + micros / 1e6 >= last + 2 * SHORT_LEASE_S)

    wait_for(past, 4 * SHORT_LEASE_S, 0.2, what="two leases past the last record")


def revoke_with_terminate_runs_never_again(rig: Rig, kind: str, task: str, signal: str | None) -> None:
    """A `task` job running on a worker of pool `kind`, revoked with terminate (`signal`, Celery's default if None):
    stopped before its side effect, REVOKED, acknowledged, not run again within two leases; the worker goes on."""
    key = uuid.uuid4().hex
    start_worker(rig.make_worker, rig.broker, rig.ledger, kind, key)
    job = send(rig.producer, task, key)
    wait_for(lambda: run_count(rig.ledger, key, "start")[job] == 1, 30, 0.05, what="the job to start")
    rig.producer.AsyncResult(job).revoke(terminate=True, signal=signal)
    revoked_and_settled(rig.producer, rig.broker, job)
    two_leases_past(rig.ledger, key)
    assert run_count(rig.ledger, key, "start") == collections.Counter({job: 1})
    assert run_count(rig.ledger, key, "finish") == collections.Counter()  # stopped before its side effect
    assert rig.producer.AsyncResult(job).state == "REVOKED"
    assert settled(rig.broker)
    # The worker goes on: the next job runs to its end.
    after = send(rig.producer, task, key, sleep_s=0)
    assert key_of(rig.producer.AsyncResult(after).get(timeout=30)) == key
